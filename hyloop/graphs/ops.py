"""Graph-native ops: radix keys of generated rows, the track-slot scatter and the KV write.

Every op here runs inside the captured decode step, so each is a fixed-shape tensor program:
no host reads, no data-dependent shapes, no Python value that changes per step. The only
Python values are static per bucket (channel count, ``end_id``, ``hash_space``). Each op is
checked by ``hyloop.graphs.safety`` in the unit tests.

Radix keys:

* Token models: the key of a token is its id; the sampled int64 ids serve as keys unchanged.
* Multi-channel rows ``[B, C]`` (channel 0 = text id, channels 1.. = codes) generated on device:
  a Horner polynomial over all C channels modulo the Mersenne prime ``2**31 - 1``, folded into
  ``[0, hash_space)``; rows whose text channel is the end id keep the end id, so stop checks
  and the radix tree see the real EOS (``row_radix_keys``).
  This is the key sglang-omni publishes for MOSS-TTS Local, bit for bit.
* The engine's key of a row, generated or prompt (``row_keys``): two independent Horner hashes
  (moduli ``2**31 - 1`` and ``2**31 - 19``, bases 1e9+7 and 998244353) packed into 62 bits and
  lifted to ``[2**62, 2**63)``, so no row key equals a real end id, which rows whose channel 0 is
  the end id keep. The same op keys prompt rows (on the host, before prefill) and generated rows
  (in the captured step), so a row resent in a prompt has the key it was generated with.
"""

from __future__ import annotations

import torch

__all__ = [
    "HORNER_BASE",
    "HORNER_MOD",
    "ROW_HASH_SPACE",
    "row_keys",
    "row_radix_keys",
    "row_radix_keys_raw",
    "scatter_track_slots",
    "write_kv",
]

HORNER_MOD = 2**31 - 1  # Mersenne prime: adjacent rows can never collide before folding.
HORNER_BASE = 1_000_000_007
ROW_HASH_SPACE = 151643  # text vocabulary size of the Qwen-family TTS backbones

# NOTE: the base is reduced mod MOD once, so every Horner step computes acc * base + value with
# acc, base, value < 2**31: the product stays below 2**62 and the sum below 2**63 (no int64
# overflow, so CPU and GPU give bit-identical keys).
_BASE_REDUCED = HORNER_BASE % HORNER_MOD
# ``row_keys``: (modulus, base reduced by it) of the high and the low 31 bits.
_KEY_HASHES = ((HORNER_MOD, _BASE_REDUCED), (2**31 - 19, 998_244_353))
_KEY_OFFSET = 1 << 62


def row_radix_keys_raw(rows: torch.Tensor) -> torch.Tensor:
    """Horner hash of each row ``[B, C]`` in ``[0, 2**31 - 1)``, before folding.

    ``acc = (acc * BASE + (row[c] mod MOD)) mod MOD`` over c = 0..C-1 with floor remainders
    (negative and >= MOD channel values are reduced first), ``acc`` starting at 0.
    """
    _require_rows(rows)
    values = torch.remainder(rows.to(torch.int64), HORNER_MOD)
    acc = torch.zeros_like(values[:, 0])
    # C is static per model, so the loop unrolls into C fused multiply-add-mod steps.
    for c in range(values.shape[1]):
        acc = torch.remainder(acc * _BASE_REDUCED + values[:, c], HORNER_MOD)
    return acc


def row_radix_keys(
    rows: torch.Tensor, end_id: int, hash_space: int = ROW_HASH_SPACE
) -> torch.Tensor:
    """Radix key of each generated row ``[B, C]``: int64 ``[B]`` on the rows' device.

    ``row_radix_keys_raw(rows) % hash_space``, except rows whose channel 0 equals ``end_id``,
    which keep ``end_id``.
    """
    _require_rows(rows)
    if isinstance(end_id, bool) or not isinstance(end_id, int):
        raise TypeError(f"end_id must be an int, got {type(end_id).__name__} {end_id!r}")
    if isinstance(hash_space, bool) or not isinstance(hash_space, int) or hash_space <= 0:
        raise ValueError(f"hash_space must be a positive int, got {hash_space!r}")
    folded = torch.remainder(row_radix_keys_raw(rows), hash_space)
    is_end = rows[:, 0].to(torch.int64) == end_id
    return torch.where(is_end, torch.full_like(folded, end_id), folded)


def row_keys(rows: torch.Tensor, end_id: int) -> torch.Tensor:
    """The engine's radix key of each row ``[B, C]``: int64 ``[B]`` on the rows' device.

    ``2**62 + (h1 << 31 | h2)`` with ``h1``, ``h2`` Horner hashes of the row modulo two
    31-bit primes (floor remainders; every step below 2**63, so CPU and GPU agree bit for
    bit); rows whose channel 0 equals ``end_id`` keep ``end_id``.
    """
    _require_rows(rows)
    if isinstance(end_id, bool) or not isinstance(end_id, int) or not 0 <= end_id < 2**62:
        raise ValueError(f"end_id must be an int in [0, 2**62), got {end_id!r}")
    values = rows.to(torch.int64)
    keys = torch.full_like(values[:, 0], _KEY_OFFSET)
    for shift, (mod, base) in zip((31, 0), _KEY_HASHES, strict=True):
        v = torch.remainder(values, mod)
        acc = torch.zeros_like(v[:, 0])
        for c in range(v.shape[1]):  # C is static: the loop unrolls
            acc = torch.remainder(acc * base + v[:, c], mod)
        keys = keys + (acc << shift)
    is_end = values[:, 0] == end_id
    return torch.where(is_end, torch.full_like(keys, end_id), keys)


def scatter_track_slots(
    buf: torch.Tensor, src_slots: torch.Tensor, track_slots: torch.Tensor
) -> None:
    """Publish recurrent state: ``buf[track_slots[b]] = buf[src_slots[b]]`` for every row b.

    Rows that publish nothing carry ``track_slots[b] == 0`` and write into slot 0, the padding
    sink, so the scatter keeps one fixed shape per bucket (no mask indexing, no ``nonzero``).
    All sources are read before any destination is written.
    """
    _require_slots(src_slots, "src_slots", buf)
    _require_slots(track_slots, "track_slots", buf)
    if src_slots.shape != track_slots.shape:
        raise ValueError(
            f"src_slots and track_slots must have the same shape, got "
            f"{tuple(src_slots.shape)} and {tuple(track_slots.shape)}"
        )
    buf.index_copy_(0, track_slots, buf.index_select(0, src_slots))


def write_kv(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out_cache_loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write new K/V ``[..., kv_heads, head_dim]`` into the pool at ``out_cache_loc`` slots.

    ``out_cache_loc`` (int64) has the leading shape of ``k``/``v`` (e.g. ``[B, T]`` or ``[N]``);
    padding tokens point to slot 0, the padding sink. Values in another dtype than the buffer's
    are cast to it; values already in the buffer dtype are written as they are (no copy).
    """
    # NOTE: every attention layer calls this once per step, and in an eager step these checks
    # run each time, so they are plain comparisons; messages are built only on failure. Both
    # inputs are checked before either buffer is written.
    if out_cache_loc.dtype != torch.int64:
        raise TypeError(f"out_cache_loc must be int64, got {out_cache_loc.dtype}")
    for name, buf, new in (("k", k_buf, k), ("v", v_buf, v)):
        if buf.dim() != 3 or new.shape[-2:] != buf.shape[1:]:
            _raise_kv_shape(name, buf, new)
        if new.shape[:-2] != out_cache_loc.shape:
            raise ValueError(
                f"{name} leading shape {tuple(new.shape[:-2])} must match out_cache_loc shape "
                f"{tuple(out_cache_loc.shape)}"
            )
    loc = out_cache_loc.reshape(-1)
    k_buf.index_copy_(0, loc, _as_slot_rows(k, k_buf))
    v_buf.index_copy_(0, loc, _as_slot_rows(v, v_buf))


def _as_slot_rows(new: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``new`` as ``[N, kv_heads, head_dim]`` rows in ``buf``'s dtype; a view when it can be."""
    if new.dtype != buf.dtype:
        new = new.to(buf.dtype)
    return new.reshape(-1, *buf.shape[1:])


def _raise_kv_shape(name: str, buf: torch.Tensor, new: torch.Tensor) -> None:
    if buf.dim() != 3:
        raise ValueError(
            f"{name}_buf must be [num_slots, kv_heads, head_dim], got shape {tuple(buf.shape)}"
        )
    raise ValueError(
        f"{name} must end in [kv_heads, head_dim] = {tuple(buf.shape[1:])}, "
        f"got shape {tuple(new.shape)}"
    )


def _require_int(t: torch.Tensor, name: str) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")


def _require_rows(rows: torch.Tensor) -> None:
    _require_int(rows, "rows")
    if rows.dim() != 2 or rows.shape[1] < 1:
        raise ValueError(f"rows must be [B, C] with C >= 1, got shape {tuple(rows.shape)}")


def _require_slots(slots: torch.Tensor, name: str, buf: torch.Tensor) -> None:
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise TypeError(
            f"{name} must be a 1-D int64 tensor, got {slots.dtype} shape {tuple(slots.shape)}"
        )
    if slots.device != buf.device:
        raise ValueError(f"{name} is on {slots.device} but buf is on {buf.device}")
