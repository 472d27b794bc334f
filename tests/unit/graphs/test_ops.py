"""Graph-native ops against plain-Python references: row keys, track-slot scatter, KV write."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyloop.graphs.ops import (
    row_keys,
    row_radix_keys,
    row_radix_keys_raw,
    scatter_track_slots,
    write_kv,
)
from hyloop.graphs.safety import check_capture_safe

MOD = 2**31 - 1
BASE = 1_000_000_007
SPACE = 151643
END_ID = 151670
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, NO_CUDA])]


def ref_raw(row: list[int]) -> int:
    """Horner with Python bignums: no overflow possible, % is the floor remainder."""
    acc = 0
    for value in row:
        acc = (acc * BASE + value % MOD) % MOD
    return acc


def ref_key(row: list[int], end_id: int = END_ID, space: int = SPACE) -> int:
    return end_id if row[0] == end_id else ref_raw(row) % space


def wide_rows(rng: np.random.Generator, n: int, c: int) -> torch.Tensor:
    """Rows across the whole int64 range, with the extremes and MOD boundaries planted."""
    rows = rng.integers(I64_MIN, I64_MAX, size=(n, c), dtype=np.int64, endpoint=True)
    planted = [I64_MIN, I64_MAX, -1, 0, 1, MOD - 1, MOD, MOD + 1, -MOD, 2 * MOD, END_ID]
    for i, value in enumerate(planted):
        rows[i % n, i % c] = value
    rows[-1, :] = I64_MAX
    rows[-2, :] = I64_MIN
    return torch.from_numpy(rows)


@pytest.mark.parametrize("c", [1, 2, 13])
def test_raw_and_folded_keys_match_bignum_reference_on_int64_rows(c: int) -> None:
    rows = wide_rows(np.random.default_rng(c), 64, c)
    expected_raw = [ref_raw(r) for r in rows.tolist()]
    assert row_radix_keys_raw(rows).tolist() == expected_raw
    assert row_radix_keys(rows, END_ID).tolist() == [ref_key(r) for r in rows.tolist()]


def test_keys_match_reference_on_int32_rows() -> None:
    rng = np.random.default_rng(7)
    rows = rng.integers(I32_MIN, I32_MAX, size=(64, 13), dtype=np.int32, endpoint=True)
    rows[0, :] = I32_MIN
    rows[1, :] = I32_MAX
    rows[2, 0] = END_ID
    t = torch.from_numpy(rows)
    keys = row_radix_keys(t, END_ID)
    assert keys.dtype == torch.int64
    assert keys.tolist() == [ref_key(r) for r in rows.tolist()]
    assert keys[2].item() == END_ID


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(I64_MIN, I64_MAX), min_size=4, max_size=4), min_size=1, max_size=8
    ),
    st.integers(1, 2**40),
)
def test_keys_match_reference_property(rows: list[list[int]], space: int) -> None:
    t = torch.tensor(rows, dtype=torch.int64)
    raw = row_radix_keys_raw(t)
    assert raw.tolist() == [ref_raw(r) for r in rows]
    assert bool(((raw >= 0) & (raw < MOD)).all())  # no wrap-around ever shows up
    assert row_radix_keys(t, END_ID, space).tolist() == [ref_key(r, END_ID, space) for r in rows]


def test_channel_order_changes_raw_key() -> None:
    rng = np.random.default_rng(3)
    base = rng.permutation(1024)[:13].tolist()  # distinct values, so every permutation differs
    perms = [list(p) for p in itertools.islice(itertools.permutations(base), 1, 200)]
    perms += [base[::-1], base[1:] + base[:1]]
    keys = row_radix_keys_raw(torch.tensor([base, *perms])).tolist()
    assert all(k != keys[0] for k in keys[1:])


def test_no_raw_collisions_on_adjacent_permuted_and_random_rows() -> None:
    rng = np.random.default_rng(11)
    bases = np.concatenate(
        [rng.integers(0, 151700, size=(40, 1)), rng.integers(0, 1024, size=(40, 12))], axis=1
    )
    rows: set[tuple[int, ...]] = set()
    for row in bases.tolist():
        rows.add(tuple(row))
        for ch in range(13):
            for delta in (-1, 1):
                adjacent = list(row)
                adjacent[ch] += delta
                rows.add(tuple(adjacent))
        for _ in range(5):
            rows.add(tuple(rng.permutation(row).tolist()))
    rows.update(map(tuple, rng.integers(I64_MIN, I64_MAX, size=(500, 13), endpoint=True).tolist()))
    keys = row_radix_keys_raw(torch.tensor(sorted(rows), dtype=torch.int64)).tolist()
    assert len(rows) > 1500
    assert len(set(keys)) == len(keys)


def test_end_rows_keep_end_id_and_others_fold_below_space() -> None:
    rows = torch.randint(0, 1024, (16, 13))
    rows[::2, 0] = END_ID
    keys = row_radix_keys(rows, END_ID)
    assert keys[::2].tolist() == [END_ID] * 8
    assert bool((keys[1::2] < SPACE).all())
    # The end id sits outside the folded range, so no generated row can fake an EOS key.
    assert END_ID >= SPACE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_keys_follow_device_and_are_int64(device: str, dtype: torch.dtype) -> None:
    rows = torch.randint(-(2**31), 2**31 - 1, (8, 13), dtype=dtype, device=device)
    keys = row_radix_keys(rows, END_ID)
    assert keys.dtype == torch.int64 and keys.device == rows.device
    assert keys.cpu().tolist() == [ref_key(r) for r in rows.cpu().tolist()]


def test_bad_rows_are_rejected_with_the_input_named() -> None:
    with pytest.raises(TypeError, match="rows must be int32 or int64"):
        row_radix_keys(torch.zeros(2, 3), END_ID)
    with pytest.raises(ValueError, match=r"rows must be \[B, C\]"):
        row_radix_keys(torch.zeros(3, dtype=torch.int64), END_ID)
    with pytest.raises(ValueError, match="hash_space"):
        row_radix_keys(torch.zeros(2, 3, dtype=torch.int64), END_ID, 0)


def ref_row_key(row: list[int], end_id: int) -> int:
    """The engine's row key with Python bignums: two Horner hashes packed above 2**62."""
    if row[0] == end_id:
        return end_id
    h = []
    for mod, base in ((2**31 - 1, 1_000_000_007), (2**31 - 19, 998_244_353)):
        acc = 0
        for value in row:
            acc = (acc * base + value % mod) % mod
        h.append(acc)
    return 2**62 + (h[0] << 31) + h[1]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(I64_MIN, I64_MAX), min_size=4, max_size=4), min_size=1, max_size=8
    )
)
def test_row_keys_match_a_bignum_reference(rows: list[list[int]]) -> None:
    got = row_keys(torch.tensor(rows, dtype=torch.int64), END_ID).tolist()
    assert got == [ref_row_key(r, END_ID) for r in rows]


def test_row_keys_keep_the_end_id_and_stay_apart_from_it() -> None:
    rows = torch.tensor([[END_ID, 1024, 1024], [151656, 3, 4], [END_ID, 0, 0], [0, 0, 0]])
    keys = row_keys(rows, END_ID).tolist()
    assert keys[0] == keys[2] == END_ID
    assert all(2**62 <= k < 2**63 for k in (keys[1], keys[3]))  # never a real end id
    # The same rows in int32 give the same keys (prompt rows arrive in any int dtype).
    assert row_keys(rows.to(torch.int32), END_ID).tolist() == keys
    with pytest.raises(ValueError, match="end_id"):
        row_keys(rows, -1)


def test_row_keys_are_wider_than_the_folded_key() -> None:
    """Rows the 151643-fold maps to one key get distinct engine keys."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 1024, (20000, 13), generator=g)
    folded = row_radix_keys(rows, END_ID)
    wide = row_keys(rows, END_ID)
    assert len(set(folded.tolist())) < len(rows)  # the fold collides at this size
    assert len(set(wide.tolist())) == len(rows)


def test_row_keys_capture_safe_and_compiled() -> None:
    rows = torch.tensor([[151656, 5, 1023], [END_ID, 1024, 1024]])
    check_capture_safe(row_keys, rows, END_ID)
    compiled = torch.compile(row_keys, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(rows, END_ID), row_keys(rows, END_ID))


def ref_scatter(buf: torch.Tensor, src: list[int], track: list[int]) -> torch.Tensor:
    out = buf.clone()
    for s, t in zip(src, track, strict=True):
        if t != 0:
            out[t] = buf[s]
    return out


def test_scatter_track_slots_matches_loop_reference() -> None:
    buf = torch.randn(9, 3, 4)
    src = [1, 2, 3, 4, 0]  # last row is padding
    track = [5, 0, 6, 2, 0]  # row 1 publishes nothing; row 3 overwrites a source of row 1
    expected = ref_scatter(buf, src, track)
    scatter_track_slots(buf, torch.tensor(src), torch.tensor(track))
    assert torch.equal(buf[1:], expected[1:])  # slot 0 is the sink, its content is free


def test_scatter_track_slots_rejects_bad_slots() -> None:
    buf = torch.zeros(4, 2)
    with pytest.raises(TypeError, match="src_slots must be a 1-D int64"):
        scatter_track_slots(buf, torch.tensor([1], dtype=torch.int32), torch.tensor([2]))
    with pytest.raises(ValueError, match="same shape"):
        scatter_track_slots(buf, torch.tensor([1, 2]), torch.tensor([2]))


def test_write_kv_matches_loop_reference() -> None:
    k_buf, v_buf = torch.zeros(12, 2, 4), torch.zeros(12, 2, 4)
    loc = torch.tensor([[3, 4, 0], [7, 0, 0]])  # [B, T], padding -> slot 0
    k, v = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
    write_kv(k_buf, v_buf, loc, k, v)
    exp_k, exp_v = torch.zeros(12, 2, 4), torch.zeros(12, 2, 4)
    for b, t in itertools.product(range(2), range(3)):
        if loc[b, t] != 0:
            exp_k[loc[b, t]] = k[b, t]
            exp_v[loc[b, t]] = v[b, t]
    assert torch.equal(k_buf[1:], exp_k[1:]) and torch.equal(v_buf[1:], exp_v[1:])


def test_write_kv_casts_and_rejects_mismatched_shapes() -> None:
    k_buf = torch.zeros(4, 1, 2, dtype=torch.bfloat16)
    v_buf = torch.zeros(4, 1, 2, dtype=torch.bfloat16)
    k = torch.ones(2, 1, 2)
    write_kv(k_buf, v_buf, torch.tensor([1, 2]), k, 2 * k)
    assert k_buf[1:3].float().tolist() == [[[1.0, 1.0]]] * 2
    assert v_buf[1:3].float().tolist() == [[[2.0, 2.0]]] * 2
    with pytest.raises(ValueError, match="must end in"):
        write_kv(k_buf, v_buf, torch.tensor([1, 2]), torch.ones(2, 2, 2), k)
    with pytest.raises(ValueError, match="out_cache_loc shape"):
        write_kv(k_buf, v_buf, torch.tensor([1, 2, 3]), k, k)
    with pytest.raises(TypeError, match="out_cache_loc must be int64"):
        write_kv(k_buf, v_buf, torch.tensor([1, 2], dtype=torch.int32), k, k)
    with pytest.raises(ValueError, match=r"v_buf must be \[num_slots"):
        write_kv(k_buf, v_buf[0], torch.tensor([1, 2]), k, k)


def test_write_kv_checks_both_inputs_before_writing_either() -> None:
    k_buf, v_buf = torch.zeros(4, 1, 2), torch.zeros(4, 1, 2)
    with pytest.raises(ValueError, match="v must end in"):
        write_kv(k_buf, v_buf, torch.tensor([1, 2]), torch.ones(2, 1, 2), torch.ones(2, 1, 3))
    assert not k_buf.any() and not v_buf.any()


def test_write_kv_writes_same_dtype_values_without_a_cast_or_copy() -> None:
    k_buf, v_buf = torch.zeros(6, 2, 4), torch.zeros(6, 2, 4)
    k, v = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
    loc = torch.tensor([[1, 2, 3], [4, 5, 0]])
    with torch.profiler.profile() as prof:
        write_kv(k_buf, v_buf, loc, k, v)
    names = [e.name for e in prof.events()]
    # The pool write is the two index_copy_ calls alone: no cast, no copy of the new K/V.
    assert not {"aten::_to_copy", "aten::copy_", "aten::clone"} & set(names)
    assert names.count("aten::index_copy_") == 2
    assert torch.equal(k_buf[1:], k.reshape(6, 2, 4)[:5])
    assert torch.equal(v_buf[1:], v.reshape(6, 2, 4)[:5])


def test_ops_pass_the_capture_safety_checker() -> None:
    rows = wide_rows(np.random.default_rng(5), 8, 13)
    keys = check_capture_safe(row_radix_keys, rows, END_ID)
    assert keys.tolist() == [ref_key(r) for r in rows.tolist()]
    check_capture_safe(row_radix_keys_raw, rows.to(torch.int32))
    buf = torch.randn(6, 2)
    expected = ref_scatter(buf, [1, 2], [3, 0])
    check_capture_safe(scatter_track_slots, buf, torch.tensor([1, 2]), torch.tensor([3, 0]))
    assert torch.equal(buf[1:], expected[1:])
    k_buf, v_buf = torch.zeros(5, 1, 2), torch.zeros(5, 1, 2)
    k = torch.randn(2, 1, 2)
    check_capture_safe(write_kv, k_buf, v_buf, torch.tensor([4, 0]), k, k)
    assert torch.equal(k_buf[4], k[0])


@pytest.mark.slow
def test_row_keys_compiled_match_eager_and_reference() -> None:
    compiled = torch.compile(row_radix_keys, fullgraph=True, dynamic=False)
    for seed, dtype in ((0, torch.int64), (1, torch.int64)):
        rows = wide_rows(np.random.default_rng(seed), 16, 13).to(dtype)
        rows[3, 0] = END_ID
        out = compiled(rows, END_ID)
        assert torch.equal(out, row_radix_keys(rows, END_ID))
        assert out.tolist() == [ref_key(r) for r in rows.tolist()]
    rows32 = torch.randint(-(2**31), 2**31 - 1, (16, 13), dtype=torch.int32)
    compiled32 = torch.compile(row_radix_keys_raw, fullgraph=True, dynamic=False)
    assert compiled32(rows32).tolist() == [ref_raw(r) for r in rows32.tolist()]


@pytest.mark.slow
def test_scatter_and_write_kv_compiled_match_reference() -> None:
    def step(
        state: torch.Tensor,
        src: torch.Tensor,
        track: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        loc: torch.Tensor,
        k: torch.Tensor,
    ) -> None:
        scatter_track_slots(state, src, track)
        write_kv(k_buf, v_buf, loc, k, k * 2)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    state = torch.randn(8, 3)
    k_buf, v_buf = torch.zeros(10, 2, 4), torch.zeros(10, 2, 4)
    for src, track, loc in (([1, 2, 3], [4, 0, 5], [5, 0, 9]), ([3, 1, 0], [6, 7, 0], [2, 8, 0])):
        expected = ref_scatter(state, src, track)
        k = torch.randn(3, 2, 4)
        compiled(state, torch.tensor(src), torch.tensor(track), k_buf, v_buf, torch.tensor(loc), k)
        assert torch.equal(state[1:], expected[1:])
        for i, slot in enumerate(loc):
            if slot:
                assert torch.equal(k_buf[slot], k[i]) and torch.equal(v_buf[slot], 2 * k[i])
