"""Radix keys and the page-aligned prefix compare the tree walks with.

Keys and node segments are packed as little-endian int64 bytes, so comparing segments is one
bytes-slice ``memcmp`` instead of a per-token Python loop. Keys (token ids, or multi-channel
models' row keys) are at most 63-bit, so int64 holds every key.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable
from typing import Any

import torch

TOKEN_BYTES = 8


def pack_tokens(token_ids: Any, what: str = "token_ids") -> bytes:
    """``token_ids`` (list, tuple, array or 1-D integer tensor) as packed int64 bytes."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise ValueError(f"{what} must be a 1-D tensor, got shape {tuple(token_ids.shape)}")
        dt = token_ids.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise ValueError(f"{what} must hold integer ids, got dtype {dt}")
        return token_ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    if isinstance(token_ids, (str, bytes, bytearray)) or not hasattr(token_ids, "__iter__"):
        raise TypeError(
            f"{what} must be a list, tuple, array or 1-D tensor of ints, "
            f"got {type(token_ids).__name__}"
        )
    try:
        return array("q", token_ids).tobytes()
    except (TypeError, OverflowError) as err:
        raise ValueError(f"{what} must hold ints in the int64 range: {err}") from None


class RadixKey:
    """Token ids plus a namespace: keys with different ``extra_key`` (any hashable: tenant id,
    dp rank, adapter id, or a tuple of them) never share a node."""

    __slots__ = ("packed", "extra_key", "_len")

    def __init__(self, token_ids: Any, extra_key: Hashable | None = None) -> None:
        self.packed: bytes = pack_tokens(token_ids)
        self._len = len(self.packed) // TOKEN_BYTES
        try:
            hash(extra_key)
        except TypeError:
            raise TypeError(
                f"extra_key must be hashable, got {type(extra_key).__name__}: {extra_key!r}"
            ) from None
        self.extra_key = extra_key

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(array("q", self.packed))

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        head = list(array("q", self.packed[: 8 * TOKEN_BYTES]))
        more = "..." if self._len > 8 else ""
        return f"RadixKey(len={self._len}, ids={head}{more}, extra_key={self.extra_key!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RadixKey):
            return NotImplemented
        return self.packed == other.packed and self.extra_key == other.extra_key

    def __hash__(self) -> int:
        return hash((self.packed, self.extra_key))


def page_match_bytes(node_key: bytes, tokens: bytes, pos: int, page_bytes: int) -> int:
    """Bytes of the common prefix of ``node_key`` and ``tokens[pos:]``, rounded down to pages.

    The caller found the node by its first page, so one page is known to match. A whole-node
    match is one slice compare; otherwise gallop then bisect over page counts, so finding the
    divergence takes O(log n) slice compares.
    """
    n = len(node_key)
    if tokens[pos : pos + n] == node_key:
        return n
    max_pages = min(n, len(tokens) - pos) // page_bytes
    lo = 1  # pages known equal
    hi = 2
    while hi <= max_pages:
        end = hi * page_bytes
        if tokens[pos : pos + end] != node_key[:end]:
            break
        lo = hi
        hi *= 2
    hi = min(hi, max_pages + 1)  # first page count not known equal
    while hi - lo > 1:
        mid = (lo + hi) // 2
        end = mid * page_bytes
        if tokens[pos : pos + end] == node_key[:end]:
            lo = mid
        else:
            hi = mid
    return lo * page_bytes
