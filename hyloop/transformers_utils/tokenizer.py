"""vLLM's ``get_tokenizer``: a checkpoint's tokenizer from an HF directory or a ``.gguf`` file.

It returns hyloop's ``TextTokenizer`` (HF-compatible: ``tok(texts).input_ids``, ``encode``,
``decode``, ``apply_chat_template``, special tokens), the tokenizer hyloop's engine serves the
same checkpoint with. Nothing is downloaded: a name that is not a local path is an error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyloop.framework.sampling_params import NotSupportedError
from hyloop.models.tokenizer import TextTokenizer

# vLLM's keywords that change nothing here (hyloop runs no remote code, reads local files only,
# and has one tokenizer implementation: ``tokenizers``' fast one).
_INERT = ("trust_remote_code", "revision", "download_dir", "cache_dir", "use_fast")


def get_tokenizer(
    tokenizer_name: str | Path,
    *args: Any,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
    download_dir: str | None = None,
    **kwargs: Any,
) -> TextTokenizer:
    """vLLM's signature. ``add_bos_token`` (HF's keyword) overrides the checkpoint's BOS rule;
    ``truncation_side`` / ``padding_side`` are accepted (hyloop's tokenizer never pads or
    truncates); any other keyword is refused by name."""
    from hyloop.models.loader import load_tokenizer

    if args:
        raise TypeError(f"get_tokenizer: unexpected positional arguments {args!r}")
    add_bos = kwargs.pop("add_bos_token", None)
    for name in ("truncation_side", "padding_side", "gguf_file", *_INERT):
        kwargs.pop(name, None)
    if kwargs:
        raise NotSupportedError(f"get_tokenizer: keywords {sorted(kwargs)} are not supported")
    path = Path(tokenizer_name).expanduser()
    tok = load_tokenizer(path)
    if tok is None:
        raise ValueError(f"get_tokenizer: {tokenizer_name} ships no tokenizer")
    if path.is_file():
        _gguf_specials(tok, path)
    if add_bos is not None:
        tok.add_bos = bool(add_bos)
    tok.name_or_path = str(tokenizer_name)
    return tok


def _gguf_specials(tok: TextTokenizer, path: Path) -> None:
    """EOS and padding ids from the file's metadata, as HF's GGUF tokenizer reads them."""
    from hyloop.models.loaders.gguf import read_gguf_file_metadata

    meta = read_gguf_file_metadata(path)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is not None and not tok.eos_ids:
        tok.eos_ids = [int(eos)]
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None and tok.pad_token_id is None:
        tok.pad_token_id = int(pad)
