"""Content-defined chunking of token ids (or row keys), so identical text chunks identically
wherever it sits.

A Gear rolling hash ``h_i = (h_{i-1} << 1) + g(t_i) mod 2**64`` forgets a token after 64 shifts,
so it is the windowed sum ``sum_{k<64} g(t_{i-k}) << k``, computed for all positions at once. A
chunk may end after token ``i`` when the top ``boundary_bits`` bits of ``h_i`` are zero: top bits
depend on the whole window, low bits only on the last few tokens. Chunks are clamped to
``[min_chunk, max_chunk]``; the first ``sink_tokens`` are never chunked (sinks are not reused).

``g(t)`` is splitmix64, so ids of any int64 value spread without a table. Fingerprints are
xxHash64 (seed 0) of the ids as little-endian int64 bytes; blake2b-8 where ``xxhash`` is missing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import xxhash
except ImportError:  # pragma: no cover - exercised only where the package is missing
    xxhash = None

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class ChunkerParams:
    window: int = 64
    boundary_bits: int = 6
    min_chunk: int = 32
    max_chunk: int = 512
    sink_tokens: int = 32

    def __post_init__(self) -> None:
        if not 1 <= self.window <= 64:
            raise ValueError(f"window must be in [1, 64] (the hash word's bits), got {self.window}")
        if not 1 <= self.boundary_bits <= 32:
            raise ValueError(f"boundary_bits must be in [1, 32], got {self.boundary_bits}")
        if not 1 <= self.min_chunk <= self.max_chunk:
            raise ValueError(
                f"need 1 <= min_chunk <= max_chunk, got min_chunk={self.min_chunk}, "
                f"max_chunk={self.max_chunk}"
            )
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")


def as_int64(token_ids: Any) -> np.ndarray:
    """``token_ids`` (list, array, tensor or packed int64 bytes) as a little-endian int64 array."""
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        return np.frombuffer(token_ids, dtype="<i8")
    if hasattr(token_ids, "numpy"):
        token_ids = token_ids.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(token_ids, dtype="<i8"))


def gear(ids: np.ndarray) -> np.ndarray:
    """splitmix64 of each id (as uint64): the per-token word of the rolling hash."""
    z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def rolling_hash(ids: np.ndarray, window: int = 64) -> np.ndarray:
    """``h_i = sum_{k < window} gear(t_{i-k}) << k (mod 2**64)`` for every position ``i``."""
    g = gear(ids)
    h = g.copy()
    n = len(g)
    for k in range(1, min(window, n)):
        h[k:] += g[: n - k] << np.uint64(k)
    return h


def fingerprint(ids: np.ndarray) -> int:
    data = np.ascontiguousarray(ids, dtype="<i8").tobytes()
    if xxhash is not None:
        return xxhash.xxh64_intdigest(data, 0)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class Chunker:
    def __init__(self, params: ChunkerParams | None = None) -> None:
        self.params = params or ChunkerParams()
        self._shift = np.uint64(64 - self.params.boundary_bits)

    def candidates(self, ids: np.ndarray) -> np.ndarray:
        """Positions ``i`` after which a chunk may end (the window is whole and the top bits 0)."""
        return self.candidates_many([ids])[0]

    def candidates_many(self, seqs: list[np.ndarray]) -> list[np.ndarray]:
        """``candidates`` of several sequences in one hash pass over their concatenation; windows
        reaching back into the previous sequence are masked."""
        p = self.params
        h = rolling_hash(np.concatenate(seqs) if len(seqs) > 1 else seqs[0], p.window)
        hit = (h >> self._shift) == 0
        out, offset = [], 0
        for ids in seqs:
            seg = hit[offset : offset + len(ids)]
            seg[: p.window - 1] = False  # a partial window would depend on the sequence start
            out.append(np.flatnonzero(seg))
            offset += len(ids)
        return out

    def cuts(self, ids: np.ndarray) -> list[tuple[int, int, bool]]:
        """``(start, end, closed)`` of every chunk of ``ids``, from ``sink_tokens`` on."""
        return self.cuts_from(len(ids), self.candidates(ids))

    def cuts_many(self, seqs: list[np.ndarray]) -> list[list[tuple[int, int, bool]]]:
        cands = self.candidates_many(seqs) if seqs else []
        return [self.cuts_from(len(ids), c) for ids, c in zip(seqs, cands, strict=True)]

    def cuts_from(self, n: int, cand: np.ndarray) -> list[tuple[int, int, bool]]:
        """The clamp pass over a sequence of ``n`` tokens with boundary candidates ``cand``."""
        p = self.params
        out: list[tuple[int, int, bool]] = []
        s = p.sink_tokens
        while s < n:
            j = np.searchsorted(cand, s + p.min_chunk - 1)
            end = int(cand[j]) + 1 if j < len(cand) else n + 1
            if end - s > p.max_chunk:
                end = s + p.max_chunk
            if end > n:
                out.append((s, n, False))
                break
            out.append((s, end, True))
            s = end
        return out
