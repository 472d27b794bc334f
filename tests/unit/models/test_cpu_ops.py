"""hyloop's C++ CPU kernels: decode attention over the paged pool and the native packed GEMM,
against plain PyTorch references, eager and inside torch.compile, plus their fallbacks."""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import BF16_PACKED
from torch import nn

from hyloop.models.cpu import cpu_ops
from hyloop.models.cpu.packed_linear import PackedLinear, packing_available
from hyloop.models.layers.attention import NativePath, PagedAttention, TorchPath
from hyloop.models.layers.attention.paged import AttentionMeta

pytestmark = pytest.mark.skipif(
    not cpu_ops.ensure_loaded(), reason="no C++ compiler: hyloop's CPU kernels cannot be built"
)


def reference(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Gather, repeat kv heads, masked softmax in float64: the obvious way."""
    b, hq, d = q.shape
    hkv = k_buf.shape[1]
    keys = k_buf[slots].double()  # [B, L, Hkv, D]
    values = v_buf[slots].double()
    keys = keys.repeat_interleave(hq // hkv, dim=2)
    values = values.repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q.double(), keys) * scale + bias.double()[:, None]
    return torch.einsum("bhl,blhd->bhd", scores.softmax(-1), values)


def case(
    dtype: torch.dtype, b: int, hq: int, hkv: int, d: int, length: int, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    num_slots = 4 * b * length + 1
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    k_buf = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    v_buf = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(num_slots - 1, generator=g)[: b * length].view(b, length) + 1
    # Row r sees columns 0..pos[r]; row 0 is a padding row that sees only column 0 (slot 0).
    pos = torch.randint(0, length, (b,), generator=g)
    pos[0] = 0
    slots[0] = 0
    cols = torch.arange(length)
    bias = torch.where(cols[None] <= pos[:, None], 0.0, float("-inf"))
    return q, k_buf, v_buf, slots, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 4, 64), (9, 3, 64), (4, 4, 40), (16, 2, 128)])
def test_decode_attention_matches_the_reference(
    dtype: torch.dtype, hq: int, hkv: int, d: int
) -> None:
    q, k_buf, v_buf, slots, bias = case(dtype, 6, hq, hkv, d, 37)
    scale = 1 / math.sqrt(d)
    out = torch.ops.hyloop.decode_attention(q, k_buf, v_buf, slots, bias, scale)
    assert out.dtype == dtype and out.shape == q.shape
    ref = reference(q, k_buf, v_buf, slots, bias, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    # The padding row sees slot 0 alone: its output is slot 0's value rows.
    torch.testing.assert_close(
        out[0].double(), v_buf[0].double().repeat_interleave(hq // hkv, 0), atol=tol, rtol=tol
    )


def test_decode_attention_reads_only_visible_columns() -> None:
    """Masked columns may point anywhere (even at NaN rows): they are never read."""
    q, k_buf, v_buf, slots, bias = case(torch.float32, 4, 8, 2, 64, 16, seed=3)
    poisoned_k, poisoned_v = k_buf.clone(), v_buf.clone()
    seen = set(slots[bias == 0].tolist())
    hidden = [s for s in slots[bias == float("-inf")].tolist() if s not in seen]
    assert hidden
    poisoned_k[hidden] = float("nan")
    poisoned_v[hidden] = float("nan")
    args = (slots, bias, 0.125)
    clean = torch.ops.hyloop.decode_attention(q, k_buf, v_buf, *args)
    poisoned = torch.ops.hyloop.decode_attention(q, poisoned_k, poisoned_v, *args)
    assert torch.equal(clean, poisoned)


def test_decode_attention_sliding_window_bias() -> None:
    """A window masks columns on both sides; the kernel follows the bias, whatever its shape."""
    q, k_buf, v_buf, slots, _ = case(torch.float32, 3, 4, 2, 32, 24, seed=5)
    cols = torch.arange(24)
    pos = torch.tensor([20, 9, 23])
    visible = (cols[None] <= pos[:, None]) & (cols[None] > pos[:, None] - 6)
    bias = torch.where(visible, 0.0, float("-inf"))
    out = torch.ops.hyloop.decode_attention(q, k_buf, v_buf, slots, bias, 0.2)
    torch.testing.assert_close(
        out.double(), reference(q, k_buf, v_buf, slots, bias, 0.2), atol=1e-5, rtol=1e-5
    )


def test_compiled_decode_attention_is_bit_identical_to_eager() -> None:
    q, k_buf, v_buf, slots, bias = case(torch.bfloat16, 8, 8, 4, 64, 64, seed=7)

    def step(q: torch.Tensor) -> torch.Tensor:
        out = torch.ops.hyloop.decode_attention(q * 2, k_buf, v_buf, slots, bias, 0.125)
        return out.float().sum(-1)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(q), step(q))


def test_decode_attention_rejects_bad_input() -> None:
    q, k_buf, v_buf, slots, bias = case(torch.float32, 2, 4, 2, 16, 8)
    with pytest.raises(RuntimeError, match="slots must be int64"):
        torch.ops.hyloop.decode_attention(q, k_buf, v_buf, slots.int(), bias, 1.0)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        torch.ops.hyloop.decode_attention(q, k_buf, v_buf, slots, bias[:, :4], 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.hyloop.decode_attention(q.double(), k_buf, v_buf, slots, bias, 1.0)


def test_paged_attention_native_decode_matches_the_torch_path() -> None:
    """The layer's decode on the native compute path equals its torch path (fp32)."""
    from types import SimpleNamespace

    q, k_buf, v_buf, slots, bias = case(torch.float32, 4, 8, 2, 64, 32, seed=11)
    layer = PagedAttention(8, 2, 64, 0.125)
    # Decode writes this step's K/V first: point it at a spare slot, then read it back too.
    new_k = torch.randn(4, 1, 2, 64)
    new_v = torch.randn(4, 1, 2, 64)
    loc = torch.arange(4).view(4, 1) + k_buf.shape[0] - 4
    meta = AttentionMeta(slots.reshape(-1), bias.view(4, 1, 1, -1), loc)

    def batch(compute: object) -> SimpleNamespace:
        kv = SimpleNamespace(k=[k_buf.clone()], v=[v_buf.clone()])
        pools = SimpleNamespace(kv=kv, compute=compute)
        return SimpleNamespace(meta={("attention", None, False): meta}, pools=pools)

    torch_out = layer(q.view(4, 1, 8, 64), new_k, new_v, batch(TorchPath()))
    native_out = layer(q.view(4, 1, 8, 64), new_k, new_v, batch(NativePath()))
    torch.testing.assert_close(native_out, torch_out, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not packing_available(torch.device("cpu")), reason="no oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, BF16_PACKED])
def test_native_packed_linear_equals_the_packed_call(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layer = PackedLinear(nn.Linear(256, 384).to(dtype), "packed")
    model = nn.Sequential(layer)
    cpu_ops.register_packed(model)
    assert layer.native
    x = torch.randn(8, 256, dtype=dtype)
    assert torch.equal(torch.ops.hyloop.packed_linear_native(x, layer.handle), layer.run_packed(x))
    compiled = torch.compile(lambda t: F.relu(model(t)), fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), F.relu(layer.run_packed(x)))


@pytest.mark.skipif(not packing_available(torch.device("cpu")), reason="no oneDNN")
def test_native_packed_weights_are_released_with_their_layer() -> None:
    layer = PackedLinear(nn.Linear(256, 256), "packed")
    cpu_ops.register_packed(nn.Sequential(layer))
    handle = layer.handle
    x = torch.randn(2, 256)
    torch.ops.hyloop.packed_linear_native(x, handle)
    del layer
    gc.collect()
    with pytest.raises(RuntimeError, match="no packed weight"):
        torch.ops.hyloop.packed_linear_native(x, handle)


def test_the_library_is_cached_per_machine_and_source() -> None:
    path = cpu_ops.library_path()
    assert path.exists() and path.suffix == ".so"
    assert path == cpu_ops.library_path()  # stable key: loaded, not rebuilt


@pytest.mark.parametrize("k", [1, 2, 25, 32, 64])
def test_topk_rows_matches_a_stable_sort(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(9, 1024, generator=g)
    x[1, 100:200] = 3.0  # ties: the lower index first
    x[2] = 0.0
    x[3, ::3] = float("-inf")
    values, indices = torch.ops.hyloop.topk_rows(x, k)
    order = torch.sort(-x, dim=-1, stable=True).indices[:, :k]
    assert torch.equal(indices, order)
    assert torch.equal(values, x.gather(1, order))
    compiled = torch.compile(lambda t: torch.ops.hyloop.topk_rows(t * 2, k), fullgraph=True)
    assert torch.equal(compiled(x)[1], torch.ops.hyloop.topk_rows(x * 2, k)[1])


def test_topk_rows_rejects_bad_k() -> None:
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.hyloop.topk_rows(torch.zeros(2, 8), 9)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.hyloop.topk_rows(torch.zeros(2, 8, dtype=torch.float64), 2)


@pytest.mark.parametrize("vocab", [1, 7, 31, 32, 100, 49152])
def test_argmax_rows_is_torchs_argmax(vocab: int) -> None:
    """The greedy rows' kernel: the first index of the largest value, a NaN the largest."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    x[1] = -torch.inf  # every value the same: index 0
    x[2] = torch.randint(0, 3, (vocab,), generator=g).float()  # ties everywhere
    if vocab > 20:
        x[3, 5], x[3, 17] = torch.nan, torch.nan  # the first NaN wins
        x[4, vocab - 1] = torch.nan  # a NaN in the tail
        x[5, [3, vocab - 2]] = 1e9  # the same maximum twice, in a lane and the tail
        x[6, 16 * (vocab // 32)] = 1e9
    x[7] = torch.where(x[7] > 0, torch.zeros_like(x[7]), -torch.zeros_like(x[7]))  # +0 / -0
    got = torch.ops.hyloop.argmax_rows(x)
    assert got.dtype == torch.long
    assert got.tolist() == x.argmax(dim=-1).tolist() == x.max(dim=-1).indices.tolist()
    empty = torch.ops.hyloop.argmax_rows(x[:0])
    assert empty.shape == (0,)
