"""Structured outputs, host side: SmolLM2's real tokenizer, no model.

Seeded random walks through each constraint (fill the bitmask, sample an allowed token, accept
it) must end in text that Python's own ``json`` / ``re`` and a small schema checker accept.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hyloop import SamplingParams
from hyloop.features.grammar import GrammarMatcher, compile_grammar, grammar_tokenizer
from hyloop.framework.sampling_params import NotSupportedError
from hyloop.models.tokenizer import TextTokenizer
from hyloop.sampling_params import StructuredOutputsParams

TOKENIZER_VOCAB = 49152
VOCAB = TOKENIZER_VOCAB + 40  # logits wider than the tokenizer, as padded embeddings are
MAX_STEPS = 200
FILL_TIMES: list[float] = []


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> TextTokenizer:
    """The checkpoint's tokenizer, built as hyloop's loader builds it, with its EOS id."""
    from hyloop.models.loaders.gguf import read_gguf_file_metadata
    from hyloop.models.loaders.gguf_tokenizer import add_bos_token, build_gguf_tokenizer

    meta = read_gguf_file_metadata(gguf_path)
    return TextTokenizer(
        build_gguf_tokenizer(meta),
        add_bos=add_bos_token(meta),
        bos_id=int(meta["tokenizer.ggml.bos_token_id"]),
        chat_template=None,
        eos_ids=[int(meta["tokenizer.ggml.eos_token_id"])],
    )


@pytest.fixture(scope="module")
def eos(tok: TextTokenizer) -> int:
    assert tok.eos_token_id is not None
    return tok.eos_token_id


@pytest.fixture(scope="module")
def ll(tok: TextTokenizer) -> Any:
    return grammar_tokenizer(tok, VOCAB)  # EOS: the tokenizer's


def allowed_ids(bitmask: torch.Tensor, row: int, vocab: int = VOCAB) -> torch.Tensor:
    bits = (bitmask[row].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


@dataclasses.dataclass
class Walker:
    """Random outputs of a constraint: at each step fill the bitmask, sample an allowed token
    (short tokens and closing characters first, so that walks end), accept it."""

    tok: TextTokenizer
    ll: Any
    eos: int
    weights: torch.Tensor

    def walk(self, params: StructuredOutputsParams, seed: int) -> str | None:
        """The text of one walk (None: no EOS within MAX_STEPS tokens)."""
        gen = torch.Generator().manual_seed(seed)
        matcher = GrammarMatcher(params, self.ll)
        bitmask = torch.full((3, matcher.words), -1, dtype=torch.int32)
        ids: list[int] = []
        for _ in range(MAX_STEPS):
            t0 = time.perf_counter()
            matcher.fill_bitmask(bitmask, 1)
            FILL_TIMES.append(time.perf_counter() - t0)
            assert (bitmask[[0, 2]] == -1).all(), "only the request's own row is written"
            allowed = allowed_ids(bitmask, 1)
            assert not allowed[TOKENIZER_VOCAB:].any(), "ids past the tokenizer: never allowed"
            if matcher.is_finished:
                assert allowed.nonzero().flatten().tolist() == [self.eos]
            w = self.weights * allowed
            w[self.eos] = 0.0
            if allowed[self.eos] and (w.sum() == 0 or torch.rand((), generator=gen) < 0.4):
                assert matcher.accept(self.eos) and matcher.is_terminated
                matcher.fill_bitmask(bitmask, 1)
                assert allowed_ids(bitmask, 1).nonzero().flatten().tolist() == [self.eos]
                return self.tok.decode(ids)
            assert w.sum() > 0, "the mask allows some token"
            cdf = w.cumsum(0)
            u = torch.rand((), dtype=cdf.dtype, generator=gen) * cdf[-1]
            token = int(torch.searchsorted(cdf, u, right=True))
            assert matcher.accept(token), f"the mask allowed {token}; accept() must take it"
            ids.append(token)
        return None

    def walks(self, params: StructuredOutputsParams, n: int = 8) -> list[str]:
        texts = [self.walk(params, seed) for seed in range(n)]
        done = [t for t in texts if t is not None]
        assert len(done) >= n // 2, f"{len(done)} of {n} walks ended: {texts}"
        return done


@pytest.fixture(scope="module")
def walker(tok: TextTokenizer, ll: Any, eos: int) -> Walker:
    weights = torch.zeros(VOCAB, dtype=torch.float64)
    texts = tok.tokenizer.decode_batch([[i] for i in range(TOKENIZER_VOCAB)])
    for i, text in enumerate(texts):
        if text:
            weights[i] = (20.0 if any(c in text for c in '"}]),.!') else 1.0) / len(text) ** 2
    return Walker(tok, ll, eos, weights)


# -------------------------------------------------------------------------- a schema checker


def conforms(value: Any, schema: dict[str, Any]) -> bool:
    """The subset of JSON Schema the tests use, checked independently of llguidance."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if kind in types and not isinstance(value, types[kind]):
        return False
    if kind in ("integer", "number"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if kind == "integer" and not isinstance(value, int):
            return False
        if not schema.get("minimum", -1e300) <= value <= schema.get("maximum", 1e300):
            return False
    if isinstance(value, str) and not len(value) <= schema.get("maxLength", 10**9):
        return False
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9):
            return False
        return all(conforms(v, schema.get("items", {})) for v in value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            sub = props.get(k, extra)
            if sub is False or (sub is not True and not conforms(v, sub)):
                return False
    return True


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
TAGS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "count": {"type": "integer"},
    },
    "required": ["tags"],
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 10},
                "active": {"type": "boolean"},
            },
            "required": ["name", "active"],
        },
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    },
    "required": ["id", "owner"],
}


@pytest.mark.parametrize("schema", [PERSON, TAGS, NESTED], ids=["person", "tags", "nested"])
@pytest.mark.parametrize("as_text", [False, True], ids=["dict", "str"])
def test_json_schema_walks_validate(schema, as_text, walker) -> None:
    spec = json.dumps(schema) if as_text else schema
    params = StructuredOutputsParams(json=spec, disable_additional_properties=True)
    closed = json.loads(json.dumps(schema))
    for node in (closed, closed["properties"].get("owner", {})):
        node.setdefault("additionalProperties", False)
    for text in walker.walks(params):
        assert conforms(json.loads(text), closed), text


def test_json_object_and_no_whitespace(walker) -> None:
    for text in walker.walks(StructuredOutputsParams(json_object=True)):
        assert isinstance(json.loads(text), dict), text
    props = {k: PERSON["properties"][k] for k in ("age", "role")}
    tight = dict(PERSON, properties=props, required=list(props))  # no strings: no free text
    params = StructuredOutputsParams(json=tight, disable_any_whitespace=True)
    for text in walker.walks(params):
        assert conforms(json.loads(text), tight) and not re.search(r"\s", text), text
    params = StructuredOutputsParams(json=tight, whitespace_pattern="[ ]{0,2}")
    texts = walker.walks(params)
    for text in texts:
        assert conforms(json.loads(text), tight) and not re.search(r"[^ \S]| {3}", text), text
    assert any(" " in text for text in texts)


@pytest.mark.parametrize(
    "pattern",
    [
        r"[0-9]{3}-[0-9]{4}",  # not \d: llguidance's \d is Unicode's digits, newer than Python's
        r"(yes|no|maybe)( [a-z]{1,5}){0,3}",
        r"[A-Z][a-z]{2,8}@[a-z]{1,6}\.(com|org)",
    ],
)
def test_regex_walks_match(pattern, walker) -> None:
    for text in walker.walks(StructuredOutputsParams(regex=pattern)):
        assert re.fullmatch(pattern, text), text


def test_choice_walks_are_one_choice(walker) -> None:
    choices = ["red", "blue", "blueberry", "dark blue", "naïve ünïcode", 'say "hi"']
    seen = set()
    for text in walker.walks(StructuredOutputsParams(choice=choices)):
        assert text in choices
        seen.add(text)
    assert len(seen) > 1


LARK = r"""
start: list
list: "[" (item ("," item)*)? "]"
item: NUMBER | list
NUMBER: /0|[1-9][0-9]{0,2}/
"""
GBNF = r"""
root ::= greeting " " name ("!" | ".")
greeting ::= "hello" | "hi"
name ::= [A-Z] [a-z]{1,6}
"""


def test_lark_grammar_walks_parse(walker) -> None:
    for text in walker.walks(StructuredOutputsParams(grammar=LARK)):
        # The language is nested lists of small ints, written without spaces: JSON re-renders
        # every sentence exactly.
        assert json.dumps(json.loads(text), separators=(",", ":")) == text


def test_gbnf_grammar_walks_match(walker) -> None:
    for text in walker.walks(StructuredOutputsParams(grammar=GBNF)):
        assert re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,6}[!.]", text), text


# ------------------------------------------------------------------------- the matcher itself


def ids_of(tok: TextTokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_disallowed_token_is_refused_and_changes_nothing(tok, ll, eos) -> None:
    matcher = GrammarMatcher(StructuredOutputsParams(regex=r"\d{3}"), ll)
    for bad in [*ids_of(tok, "a"), eos, -1, VOCAB, VOCAB + 5, TOKENIZER_VOCAB + 3]:
        assert not matcher.accept(bad)
    assert matcher.error is None and not matcher.is_finished
    assert all(matcher.accept(t) for t in ids_of(tok, "123"))
    assert matcher.is_finished and not matcher.is_terminated
    assert not matcher.accept(ids_of(tok, "4")[0])
    assert matcher.accept(eos) and matcher.is_terminated


def test_finished_matcher_allows_only_eos(tok, ll, eos) -> None:
    matcher = GrammarMatcher(StructuredOutputsParams(choice=["yes"]), ll)
    bitmask = torch.full((2, matcher.words), -1, dtype=torch.int32)
    for t in ids_of(tok, "yes"):
        assert matcher.accept(t)
    assert matcher.is_accepting and matcher.is_finished
    matcher.fill_bitmask(bitmask, 1)
    assert allowed_ids(bitmask, 1).nonzero().flatten().tolist() == [eos]
    # Complete but open (a+ may go on): EOS and more text are both allowed.
    open_ = GrammarMatcher(StructuredOutputsParams(regex="a+"), ll)
    assert open_.accept(ids_of(tok, "a")[0]) and open_.is_accepting and not open_.is_finished
    open_.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0)[eos] and allowed_ids(bitmask, 0).sum() > 1


@pytest.mark.parametrize("words", [1535, 1540], ids=["narrower", "wider"])
def test_bitmask_of_another_width(words, tok, ll, eos) -> None:
    matcher = GrammarMatcher(StructuredOutputsParams(regex=r"[0-9]+"), ll)
    full = torch.zeros((1, matcher.words), dtype=torch.int32)
    matcher.fill_bitmask(full, 0)
    other = torch.full((2, words), -1, dtype=torch.int32)
    matcher.fill_bitmask(other, 1)
    n = min(words, matcher.words)
    assert torch.equal(other[1, :n], full[0, :n]) and (other[1, n:] == 0).all()
    assert (other[0] == -1).all()


def test_structural_tag(tok, ll) -> None:
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<fn=get>", "schema": {"type": "object"}, "end": "</fn>"}],
        "triggers": ["<fn"],
    }
    params = StructuredOutputsParams(structural_tag=json.dumps(tag))
    good = GrammarMatcher(params, ll)
    assert all(good.accept(t) for t in ids_of(tok, 'I call <fn=get>{"a": 1}</fn> now'))
    bad = GrammarMatcher(params, ll)
    assert not all(bad.accept(t) for t in ids_of(tok, "I call <fn=get>nope"))


def test_eos_and_a_model_narrower_than_the_tokenizer(tok, eos) -> None:
    assert grammar_tokenizer(tok.tokenizer, TOKENIZER_VOCAB - 100, [eos]).vocab_size == 49152
    unnamed = TextTokenizer(tok.tokenizer, add_bos=False, bos_id=None, chat_template=None)
    with pytest.raises(ValueError, match="names no EOS id"):
        grammar_tokenizer(unnamed, TOKENIZER_VOCAB)
    with pytest.raises(ValueError, match="tokenizers.Tokenizer"):
        grammar_tokenizer(object(), TOKENIZER_VOCAB)


def test_fill_bitmask_timing(walker) -> None:
    if len(FILL_TIMES) < 100:
        walker.walks(StructuredOutputsParams(json=NESTED))
    times = sorted(FILL_TIMES)
    median = statistics.median(times)
    p90, p99 = (times[int(q * (len(times) - 1))] for q in (0.9, 0.99))
    print(
        f"\nfill_bitmask over {len(times)} fills ({VOCAB}-token vocab): median "
        f"{median * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us, "
        f"max {times[-1] * 1e6:.0f} us"
    )
    assert median < 1e-3


# ------------------------------------------------------------------------------ the params


@dataclasses.dataclass
class OldGuidedDecodingParams:  # the fields of vLLM's old class
    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    backend_was_auto: bool = False
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


@pytest.mark.parametrize(
    "value",
    [{"regex": "a+"}, OldGuidedDecodingParams(regex="a+", backend="guidance")],
    ids=["dict", "old-class"],
)
@pytest.mark.parametrize("name", ["structured_outputs", "guided_decoding"])
def test_dict_and_old_alias_become_params(name, value) -> None:
    sp = SamplingParams(**{name: value})
    sp.validate()
    assert sp.structured_outputs == StructuredOutputsParams(regex="a+")
    assert sp.guided_decoding is None


def test_compiled_grammars_are_cached() -> None:
    a = compile_grammar(StructuredOutputsParams(json=dict(PERSON)))
    assert compile_grammar(StructuredOutputsParams(json=dict(PERSON))) is a
    assert compile_grammar(StructuredOutputsParams(json=json.dumps(PERSON))) != ""


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ({}, ValueError, r"structured_outputs: set exactly one .* got none"),
        ({"regex": "a", "choice": ["b"]}, ValueError, "got regex and choice"),
        ({"regex": "a("}, ValueError, r"(?s)structured_outputs\.regex: .*unclosed group"),
        ({"regex": 5}, ValueError, r"structured_outputs\.regex: got 5"),
        ({"json": "{nope"}, ValueError, r"structured_outputs\.json: not valid JSON"),
        ({"json": {"type": "objectx"}}, ValueError, r"structured_outputs\.json: .*objectx"),
        ({"json": [1]}, ValueError, r"structured_outputs\.json: got \[1\]"),
        ({"json": {"enum": {1, 2}}}, ValueError, r"structured_outputs\.json: not JSON data"),
        ({"json": {"dependentSchemas": {}}}, NotSupportedError, r"\.json: Unimplemented"),
        ({"choice": []}, ValueError, r"structured_outputs\.choice: got \[\]"),
        ({"choice": ["a", 1]}, ValueError, r"structured_outputs\.choice"),
        ({"json_object": False}, ValueError, r"structured_outputs\.json_object"),
        ({"grammar": "root ::= missing"}, ValueError, r"\.grammar: not a valid GBNF.*missing"),
        ({"grammar": 'expr: "a"'}, ValueError, r"\.grammar: no start rule"),
        ({"grammar": " "}, ValueError, r"\.grammar: got ' '"),
        ({"structural_tag": '{"format": {}}'}, NotSupportedError, r"\.structural_tag: "),
        ({"structural_tag": "[1"}, ValueError, r"\.structural_tag: not valid JSON"),
        ({"regex": "a", "backend": "xgrammar"}, NotSupportedError, r"\.backend='xgrammar'"),
        ({"regex": "a", "colour": 1}, ValueError, r"structured_outputs\.colour: unknown field"),
        ({"json_object": True, "disable_any_whitespace": 1}, ValueError, "disable_any_white"),
        (
            {"json_object": True, "disable_any_whitespace": True, "whitespace_pattern": " "},
            ValueError,
            r"\.whitespace_pattern: set it or disable_any_whitespace",
        ),
        ("regex", ValueError, r"structured_outputs: got 'regex'; expected"),
    ],
)
def test_bad_params_name_the_field(value, error, message) -> None:
    with pytest.raises(error, match=message):
        SamplingParams(structured_outputs=value).validate("req")
    with pytest.raises(error, match=message.replace("structured_outputs", "guided_decoding")):
        SamplingParams(guided_decoding=value).validate("req")


def test_params_check_at_construction_and_both_names() -> None:
    with pytest.raises(ValueError, match="StructuredOutputsParams: set exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json and grammar"):
        StructuredOutputsParams(json={}, grammar="start: /a/")
    assert StructuredOutputsParams(choice=["a"]).constraint == "choice"
    sp = SamplingParams(structured_outputs={"regex": "a"}, guided_decoding={"regex": "b"})
    with pytest.raises(ValueError, match=r"req\.guided_decoding: the old name"):
        sp.validate("req")
