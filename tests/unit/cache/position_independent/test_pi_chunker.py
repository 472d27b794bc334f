"""Content-defined chunker: the rolling hash against a bignum Gear loop, position independence,
clamps, the sink carve-out and pinned fingerprints."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np
import pytest
import xxhash

from hyloop.cache.position_independent import chunker as chunker_mod
from hyloop.cache.position_independent.chunker import (
    Chunker,
    ChunkerParams,
    as_int64,
    fingerprint,
    rolling_hash,
)

M64 = (1 << 64) - 1


@dataclass(frozen=True)
class Chunk:
    start: int
    end: int
    fingerprint: int
    closed: bool  # ends at a content boundary or the max clamp (False: the sequence's end)

    @property
    def length(self) -> int:
        return self.end - self.start


def chunks_of(chunker: Chunker, token_ids: object) -> list[Chunk]:
    """Every chunk ``chunker`` cuts of ``token_ids``, with its fingerprint."""
    ids = as_int64(token_ids)
    return [Chunk(s, e, fingerprint(ids[s:e]), closed) for s, e, closed in chunker.cuts(ids)]


def splitmix64_ref(t: int) -> int:
    z = (t + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def test_rolling_hash_equals_the_gear_loop() -> None:
    ids = np.random.default_rng(1).integers(-(2**62), 2**62, 300)
    h, ref = 0, []
    for t in ids.tolist():
        h = ((h << 1) + splitmix64_ref(t & M64)) & M64
        ref.append(h)
    assert rolling_hash(ids).tolist() == ref


def test_same_content_chunks_the_same_after_any_prefix() -> None:
    rng = np.random.default_rng(2)
    chunker = Chunker()
    doc = rng.integers(0, 50_000, 3000)
    cut_sets = []
    for trial in range(6):
        prefix = rng.integers(0, 50_000, int(rng.integers(65, 900)))
        ids = np.concatenate([prefix, doc])
        chunks = chunks_of(chunker, ids)
        # (start, end, fingerprint) relative to the document, for chunks inside it
        inside = {
            (c.start - len(prefix), c.end - len(prefix), c.fingerprint)
            for c in chunks
            if c.start >= len(prefix) and c.closed
        }
        cut_sets.append(inside)
        assert trial == 0 or cut_sets[0] & inside
    first = sorted(cut_sets[0])
    for other in cut_sets[1:]:
        common = sorted(cut_sets[0] & other)
        # once both chunkings cut at the same place, every later chunk is identical
        sync = common[0][0]
        assert sync < 64 + 2 * 512
        assert [c for c in first if c[0] >= sync] == [c for c in sorted(other) if c[0] >= sync]


@pytest.mark.parametrize("bits", [1, 7, 30])
def test_chunk_lengths_are_clamped(bits: int) -> None:
    params = ChunkerParams(boundary_bits=bits, min_chunk=32, max_chunk=512)
    ids = np.random.default_rng(3).integers(0, 50_000, 5000)
    chunks = chunks_of(Chunker(params), ids)
    assert chunks[0].start == params.sink_tokens
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:], strict=False))
    assert chunks[-1].end == len(ids)
    assert all(32 <= c.length <= 512 for c in chunks if c.closed)
    assert all(c.closed for c in chunks[:-1])
    if bits == 30:  # (almost) no content boundary: the max clamp cuts
        assert [c.length for c in chunks[:-1]] == [512] * (len(chunks) - 1)
    if bits == 1:  # a boundary every other token: the min clamp holds them apart
        assert min(c.length for c in chunks[:-1]) == 32


def test_sink_positions_never_start_a_chunk() -> None:
    chunker = Chunker(ChunkerParams(sink_tokens=32))
    assert chunks_of(chunker, list(range(20))) == []
    short = chunks_of(chunker, list(range(40)))
    assert [(c.start, c.end, c.closed) for c in short] == [(32, 40, False)]
    ids = np.random.default_rng(4).integers(0, 50_000, 2000)
    assert min(c.start for c in chunks_of(chunker, ids)) == 32
    assert chunks_of(Chunker(ChunkerParams(sink_tokens=0)), ids)[0].start == 0


def test_fingerprints_are_xxh64_of_little_endian_int64() -> None:
    ids = list(range(1000))
    chunks = chunks_of(Chunker(ChunkerParams(boundary_bits=7)), ids)  # the cuts pinned below
    for c in chunks:
        data = struct.pack(f"<{c.length}q", *ids[c.start : c.end])
        assert c.fingerprint == xxhash.xxh64(data, seed=0).intdigest()
    # Pinned: the same on every run and host.
    assert [(c.start, c.end, c.fingerprint) for c in chunks[:3]] == [
        (32, 219, 0x9FE1FBEA321992D2),
        (219, 478, 0x9D390F78458D1059),
        (478, 698, 0xC4CBA98A84434511),
    ]


def test_blake2b_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunker_mod, "xxhash", None)
    ids = [2**62 + 5, -3, 7]
    data = struct.pack("<3q", *ids)
    want = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    assert chunker_mod.fingerprint(np.array(ids)) == want


def test_bad_params_are_refused() -> None:
    with pytest.raises(ValueError, match="min_chunk"):
        ChunkerParams(min_chunk=600, max_chunk=512)
    with pytest.raises(ValueError, match="window"):
        ChunkerParams(window=65)


def test_one_hash_pass_over_many_sequences_cuts_each_as_alone() -> None:
    rng = np.random.default_rng(5)
    chunker = Chunker()
    seqs = [rng.integers(0, 50_000, int(n)) for n in rng.integers(1, 1500, 12)]
    assert chunker.cuts_many(seqs) == [chunker.cuts(s) for s in seqs]
    assert chunker.cuts_many([]) == []
