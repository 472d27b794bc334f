"""A `tokenizers.Tokenizer` rebuilt from the metadata of a GGUF file.

A GGUF carries no `tokenizer.json`, only the vocabulary, merges, token types and special ids under
llama.cpp's keys (`tokenizer.ggml.*`). For byte-level BPE (model "gpt2") that rebuilds the
tokenizer exactly, except how text is split before BPE, which the file gives only by name
(`tokenizer.ggml.pre`): llama.cpp's split rule for each name is written out here.

Gemma files hold a SentencePiece-style BPE vocabulary (model "llama") with byte-fallback pieces
(`<0x41>`) and no merges; the merges are implied by the vocabulary, ranked by the order the pieces
appear in the file (Gemma's scores do not follow the merge order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

_PREFIX = "tokenizer.ggml."

# llama.cpp token types: 3 is CONTROL (<|im_start|>), 4 is USER_DEFINED (<think>).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# `tokenizer.ggml.<role>_token_id` keys whose role llama.cpp spells differently from HF.
_ROLE_RENAMES = {"unknown": "unk", "padding": "pad", "seperator": "sep"}

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's built-in regex is GPT-2's (' ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)...).
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
    # llama.cpp splits every digit alone first ("\p{N}"), then applies GPT-2's regex.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _regex_split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# `tokenizer.ggml.pre` -> how llama.cpp splits text before BPE (llama-vocab.cpp, per pre type).
_PRE_TOKENIZERS = {
    "default": _gpt2_split,
    "gpt-2": _gpt2_split,
    "smollm": _digits_then_gpt2_split,
    "starcoder": _digits_then_gpt2_split,
    "refact": _digits_then_gpt2_split,
    "llama-bpe": lambda: _regex_split(_LLAMA3_SPLIT),
    "llama3": lambda: _regex_split(_LLAMA3_SPLIT),
    "smaug-bpe": lambda: _regex_split(_LLAMA3_SPLIT),
    "qwen2": lambda: _regex_split(_QWEN2_SPLIT),
    "deepseek-r1-qwen": lambda: _regex_split(_QWEN2_SPLIT),
}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def _spell_bytes(token: str, alphabet: set[str]) -> str:
    """A vocabulary entry in the byte alphabet; entries already spelled that way pass unchanged."""
    if set(token) <= alphabet:
        return token
    table = _byte_alphabet()
    return "".join(table[b] for b in token.encode("utf-8"))


def _require(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF tokenizer metadata lacks {key!r}; expected it for byte-level BPE")
    return meta[key]


def _build_byte_level_bpe(meta: Mapping[str, Any]) -> Tokenizer:
    tokens: list[str] = list(_require(meta, _PREFIX + "tokens"))
    merge_lines: list[str] = list(_require(meta, _PREFIX + "merges"))
    pre = meta.get(_PREFIX + "pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF tokenizer.ggml.pre is {pre!r}; hyloop knows the split rules of "
            f"{sorted(_PRE_TOKENIZERS)}"
        )

    alphabet = set(_byte_alphabet().values())
    vocab = {_spell_bytes(token, alphabet): index for index, token in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    for line_no, line in enumerate(merge_lines):
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(
                f"GGUF tokenizer.ggml.merges[{line_no}] is {line!r}; expected two tokens "
                "separated by one space"
            )
        merges.append((parts[0], parts[1]))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    # A control token outside the byte alphabet is a converter mislabel; adding it would grow the
    # vocabulary past the embedding, so it is skipped (as HF does).
    _add_typed_tokens(tokenizer, meta, tokens, alphabet.issuperset, lambda token: token in vocab)
    _set_bos_eos_template(tokenizer, meta, tokens)
    return tokenizer


def _add_typed_tokens(
    tokenizer: Tokenizer,
    meta: Mapping[str, Any],
    tokens: list[str],
    control: Callable[[str], bool] = lambda token: True,
    user_defined: Callable[[str], bool] = lambda token: True,
) -> None:
    """Add the control (special) and user-defined tokens the filters keep, so they match whole in
    raw text ("<|im_start|>" is not cut into pieces)."""
    token_types: list[int] = list(meta.get(_PREFIX + "token_type") or [])
    typed = list(zip(tokens, token_types, strict=False))
    specials = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in typed
        if kind == _TOKEN_TYPE_CONTROL and control(token)
    ]
    added = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in typed
        if kind == _TOKEN_TYPE_USER_DEFINED and user_defined(token)
    ]
    if specials:
        tokenizer.add_special_tokens(specials)
    if added:
        tokenizer.add_tokens(added)


def _set_bos_eos_template(tokenizer: Tokenizer, meta: Mapping[str, Any], tokens: list[str]) -> None:
    """Add BOS/EOS on encode exactly when the file asks for it (add_bos_token / add_eos_token)."""
    bos = [int(_require(meta, _PREFIX + "bos_token_id"))] if add_bos_token(meta) else []
    before = [tokens[i] for i in bos]
    add_eos = bool(meta.get(_PREFIX + "add_eos_token", False))
    eos = [int(_require(meta, _PREFIX + "eos_token_id"))] if add_eos else []
    after = [tokens[i] for i in eos]
    if not bos and not eos:
        return
    single = [*before, "$A", *after]
    pair = [*single, *before, "$B:1", *after]
    # Each (piece, id) once: BOS and EOS may be the same token.
    wrap = list(dict.fromkeys(zip(before + after, bos + eos, strict=True)))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=wrap
    )


_SPM_SPACE = "\u2581"
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def _implied_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, ranked by the merged piece's
    position in the file (earlier first), then by the lengths of its halves."""
    rank = {token: index for index, token in enumerate(tokens)}
    found: list[tuple[int, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        local = []
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in rank and right in rank:
                local.append((rank[left], rank[right], left, right))
        local.sort()
        found.extend((index, len(left), len(right), left, right) for _, _, left, right in local)
    found.sort(key=lambda m: (m[0], m[1], m[2]))
    return [(left, right) for _, _, _, left, right in found]


def _build_gemma_bpe(meta: Mapping[str, Any]) -> Tokenizer:
    # A piece of two or more spaces is stored with real spaces; the normalizer spells them "▁".
    tokens = [
        _SPM_SPACE * len(t) if " " in t and not t.strip() else t
        for t in _require(meta, _PREFIX + "tokens")
    ]
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = meta.get(_PREFIX + "unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_implied_merges(tokens),
            unk_token=None if unk_id is None else tokens[int(unk_id)],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [normalizers.Replace(" ", _SPM_SPACE)]
    if meta.get(_PREFIX + "add_space_prefix", False):
        steps.insert(0, normalizers.Prepend(_SPM_SPACE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    _add_typed_tokens(tokenizer, meta, tokens)
    _set_bos_eos_template(tokenizer, meta, tokens)
    return tokenizer


def build_gguf_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes: byte-level BPE ("gpt2") for any architecture,
    SentencePiece-style BPE ("llama") for the Gemma family."""
    model = meta.get(_PREFIX + "model")
    arch = meta.get("general.architecture")
    if model == "gpt2":
        return _build_byte_level_bpe(meta)
    if model == "llama" and arch in _GEMMA_ARCHS:
        return _build_gemma_bpe(meta)
    raise ValueError(
        f"GGUF tokenizer.ggml.model is {model!r} (general.architecture {arch!r}); hyloop builds "
        f"tokenizers for ['gpt2'] (byte-level BPE), and for 'llama' (SentencePiece BPE) only "
        f"with architectures {list(_GEMMA_ARCHS)}"
    )


def has_tokenizer(meta: Mapping[str, Any]) -> bool:
    return _PREFIX + "model" in meta


def add_bos_token(meta: Mapping[str, Any]) -> bool:
    """tokenizer.ggml.add_bos_token; absent, llama.cpp and HF add BOS only for sentencepiece."""
    flag = meta.get(_PREFIX + "add_bos_token")
    if flag is None:
        return meta.get(_PREFIX + "model") == "llama"
    return bool(flag)


def special_token_ids(meta: Mapping[str, Any]) -> dict[str, int]:
    """Every `tokenizer.ggml.<role>_token_id` in the file, by HF role name (bos, eos, pad...)."""
    roles: dict[str, int] = {}
    for key, value in meta.items():
        if key.startswith(_PREFIX) and key.endswith("_token_id"):
            role = key[len(_PREFIX) : -len("_token_id")]
            roles[_ROLE_RENAMES.get(role, role)] = int(value)
    return roles


def eos_token_ids(meta: Mapping[str, Any]) -> list[int]:
    """Ids that end generation: eos, then end-of-turn and end-of-message if the file names them."""
    ids = [meta.get(_PREFIX + key) for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))
