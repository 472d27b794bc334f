"""Structured outputs with llguidance: a request's constraint as each step's token bitmask.

The host side of the mask. ``compile_grammar`` checks a request's constraint (compiled once per
text: an LRU); ``grammar_tokenizer`` gives
llguidance hyloop's tokenizer; a ``GrammarMatcher`` per request writes the tokens allowed next
into one row of an int32 bitmask ``[rows, ceil(vocab / 32)]`` (bit ``t`` of a row set: token
``t`` allowed; a row of -1 allows everything) and advances by each sampled token.
"""

from __future__ import annotations

import copy
import functools
import json as jsonlib
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark
from tokenizers import Tokenizer

from hyloop.features.structured_params import StructuredOutputsParams
from hyloop.framework.sampling_params import NotSupportedError

if TYPE_CHECKING:
    from hyloop.models.tokenizer import TextTokenizer

GRAMMAR_CACHE_SIZE = 256  # compiled grammar texts (tokenizer-free)
MATCHER_CACHE_SIZE = 64  # fresh matchers per (tokenizer, grammar), copied for each request
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z][A-Za-z0-9_-]*\s*::=")
# JSON Schema keywords whose values are schemas (maps of them, or one or a list of them).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_KEYS = (
    *("items", "prefixItems", "additionalItems", "unevaluatedItems", "contains"),
    *("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "contentSchema"),
    *("additionalProperties", "unevaluatedProperties", "propertyNames"),
)
_TAG_KEYS = ("begin", "schema", "end")


class _Invalid(Exception):
    """A constraint that does not compile: its field and what is wrong (``unsupported``: a
    feature llguidance does not implement)."""

    def __init__(self, field: str, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.field, self.message, self.unsupported = field, message, unsupported


def compile_grammar(params: StructuredOutputsParams, where: str = "structured_outputs") -> str:
    """llguidance's grammar for ``params``, checked; raises ``ValueError`` (or
    ``NotSupportedError``) naming ``where.<field>`` and what is wrong."""
    kind = params.constraint
    spec = getattr(params, kind)
    if kind == "choice":
        spec = jsonlib.dumps(list(spec))
    elif kind == "json_object":
        spec = ""
    elif not isinstance(spec, str):
        try:
            spec = jsonlib.dumps(spec)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}.{kind}: not JSON data ({e})") from None
    try:
        return _compile(
            kind,
            spec,
            params.disable_any_whitespace,
            params.closed_objects,
            params.whitespace_pattern,
        )
    except _Invalid as e:
        cls = NotSupportedError if e.unsupported else ValueError
        raise cls(f"{where}.{e.field}: {e.message}") from None


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _compile(kind: str, spec: str, no_ws: bool, closed: bool, ws_pattern: str | None) -> str:
    options: dict[str, Any] = {"whitespace_flexible": not no_ws}
    if ws_pattern is not None:
        options["whitespace_pattern"] = ws_pattern
    if kind == "json":
        grammar = _json_grammar(_load(spec, kind), options, closed, kind)
    elif kind == "json_object":
        grammar = _json_grammar({"type": "object"}, options, False, kind)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(spec)
    elif kind == "choice":
        grammar = llguidance.grammar_from("choice", spec)
    elif kind == "grammar":
        grammar = llguidance.LLMatcher.grammar_from_lark(_lark(spec))
    else:
        grammar = _structural_tag(_load(spec, kind), closed)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise _Invalid(kind, _brief(error), unsupported=error.startswith("Unimplemented"))
    return grammar


def _brief(error: str) -> str:
    error = error.split("<state>")[0].strip()
    return error if len(error) <= 600 else error[:600] + " ..."


def _load(spec: str, field: str) -> Any:
    try:
        return jsonlib.loads(spec)
    except ValueError as e:
        raise _Invalid(field, f"not valid JSON ({e})") from None


def _json_grammar(schema: Any, options: dict[str, Any], closed: bool, field: str) -> str:
    if not isinstance(schema, dict | bool):
        raise _Invalid(field, f"a JSON schema is an object (or a bool); got {schema!r}")
    if closed:
        schema = _close_objects(copy.deepcopy(schema))
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except ValueError as e:
        raise _Invalid(field, str(e)) from None


def _close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever an object lists its properties
    and says nothing about others: vLLM's default (xgrammar's strict mode), unless
    ``allow_additional_properties``."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            schema[key] = {name: _close_objects(s) for name, s in schema[key].items()}
    for key in _SCHEMA_KEYS:
        if isinstance(schema.get(key), dict | list):
            schema[key] = _close_objects(schema[key])
    has_props = any(isinstance(schema.get(k), dict) for k in _SCHEMA_MAPS[:2])
    if has_props and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def _lark(text: str) -> str:
    """A grammar as Lark: GBNF/EBNF (``name ::= ...`` rules, llama.cpp's and xgrammar's form)
    is converted; anything else is taken as llguidance's Lark."""
    if "%llguidance" in text or _GBNF_RULE.search(text) is None:
        return text
    try:
        return gbnf_to_lark(text)
    except Exception as e:  # the converter raises plain Exceptions with the position
        raise _Invalid("grammar", f"not a valid GBNF grammar ({e})") from None


def _structural_tag(tag: Any, closed: bool) -> str:
    field = "structural_tag"
    if not isinstance(tag, dict) or "structures" not in tag or "triggers" not in tag:
        raise _Invalid(
            field,
            'hyloop reads the {"structures": [{"begin", "schema", "end"}], "triggers": [...]} '
            "form only",
            unsupported=True,
        )
    triggers, structures = tag["triggers"], tag["structures"]
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise _Invalid(field, f"triggers: expected a list of non-empty str; got {triggers!r}")
    if not isinstance(structures, list) or not structures:
        raise _Invalid(field, f"structures: expected a non-empty list; got {structures!r}")
    tags = []
    for i, s in enumerate(structures):
        begin, schema, end = (s.get(k) if isinstance(s, dict) else None for k in _TAG_KEYS)
        if not isinstance(begin, str) or not isinstance(end, str) or schema is None:
            raise _Invalid(field, f"structures[{i}]: expected begin, schema and end; got {s!r}")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise _Invalid(field, f"structures[{i}].begin={begin!r} starts with no trigger")
        schema = _load(schema, field) if isinstance(schema, str) else schema
        if not isinstance(schema, dict):
            raise _Invalid(field, f"structures[{i}].schema: expected a JSON schema object")
        schema = _close_objects(copy.deepcopy(schema)) if closed else schema
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    return llguidance.StructTag.to_grammar(tags)


def grammar_tokenizer(
    tokenizer: TextTokenizer | Tokenizer | Any,
    vocab_size: int,
    eos_token_ids: Sequence[int] | None = None,
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for ``tokenizer`` (hyloop's ``TextTokenizer``, an HF fast
    tokenizer or a ``tokenizers.Tokenizer``) and a model whose logits are ``vocab_size`` wide:
    ids past the tokenizer's vocabulary are never allowed. EOS: ``eos_token_ids``, else the
    tokenizer's. Costly (~0.4 s for 49k tokens): build one per engine."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "tokenizer", None)
    backend = tokenizer if isinstance(tokenizer, Tokenizer) else backend
    if not isinstance(backend, Tokenizer):
        raise ValueError(
            f"grammar_tokenizer: got {type(tokenizer).__name__}; expected a TextTokenizer, an "
            "HF fast tokenizer or a tokenizers.Tokenizer"
        )
    if eos_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_token_ids = list(getattr(tokenizer, "eos_ids", None) or ([] if eos is None else [eos]))
    if not eos_token_ids:
        raise ValueError("grammar_tokenizer: the tokenizer names no EOS id; pass eos_token_ids")
    spec = jsonlib.loads(backend.to_str())
    spec["padding"] = spec["truncation"] = None  # the grammar sees tokens, never a padded batch
    n_vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
    return llguidance.LLTokenizer(
        jsonlib.dumps(spec), n_vocab=n_vocab, eos_token=[int(t) for t in eos_token_ids]
    )


@functools.lru_cache(maxsize=MATCHER_CACHE_SIZE)
def _fresh_matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise _Invalid("grammar", _brief(matcher.get_error()))
    return matcher


class GrammarMatcher:
    """One request's place in its constraint. ``fill_bitmask`` writes the tokens allowed next;
    ``accept`` advances by the sampled token. Once the output is complete and nothing may
    follow (``is_finished``) only EOS is allowed; accepting EOS ``is_terminated`` the output."""

    def __init__(
        self,
        params: StructuredOutputsParams,
        tokenizer: llguidance.LLTokenizer,
        where: str = "structured_outputs",
    ) -> None:
        grammar = compile_grammar(params, where)
        try:
            # Compiling a grammar for a tokenizer costs ~1-5 ms; a copy of a fresh one, ~10 us.
            self._matcher = _fresh_matcher(tokenizer, grammar).deep_copy()
        except _Invalid as e:
            raise ValueError(f"{where}.{params.constraint}: {e.message}") from None
        self.eos_token_ids = frozenset(tokenizer.eos_tokens)
        self.vocab_size = tokenizer.vocab_size
        self.words = (self.vocab_size + 31) // 32
        self._terminated = False
        self._scratch: torch.Tensor | None = None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into ``bitmask[row]`` (int32, CPU, ``[rows, words]``);
        words past this tokenizer's are cleared. llguidance computes it without the GIL."""
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
            raise ValueError(
                f"fill_bitmask: got a {bitmask.dtype} {tuple(bitmask.shape)} tensor on "
                f"{bitmask.device}; expected int32 [rows, words] on the CPU"
            )
        target = bitmask[row]
        if target.shape[0] == self.words and target.is_contiguous():
            self._fill(target)
            return
        if self._scratch is None:
            self._scratch = torch.empty(self.words, dtype=torch.int32)
        self._fill(self._scratch)
        n = min(self.words, target.shape[0])
        target[:n] = self._scratch[:n]
        target[n:] = 0

    def _fill(self, words: torch.Tensor) -> None:
        # llguidance writes the mask straight into the tensor's memory, without the GIL. (Its
        # llguidance.torch helper does the same but imports torch._dynamo, ~4 s.)
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), self.words * 4)

    def accept(self, token_id: int) -> bool:
        """Advances by ``token_id``; False (and no change) when the constraint disallows it."""
        if self._matcher.is_stopped():
            ok = token_id in self.eos_token_ids
            self._terminated |= ok
            return ok
        # NOTE: checked first so that a rejected token leaves the matcher usable.
        if not 0 <= token_id < self.vocab_size or self._matcher.validate_tokens([token_id]) != 1:
            return False
        if not self._matcher.consume_token(token_id):
            return False
        self._terminated = token_id in self.eos_token_ids
        return True

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete: EOS may come next."""
        return self._matcher.is_accepting()

    @property
    def is_finished(self) -> bool:
        """Nothing but EOS may come next (the output is complete, or the matcher failed)."""
        return self._matcher.is_stopped()

    @property
    def is_terminated(self) -> bool:
        """EOS was accepted after a complete output."""
        return self._terminated

    @property
    def error(self) -> str | None:
        return _brief(self._matcher.get_error()) or None
