"""hyloop's CPU numerics (``models.cpu.numerics``) against its C++ kernels, bit for bit: exp,
SiLU and the lane sum of squares (``hyloop::vector_math``), decode attention over a paged pool
(float32 and bfloat16 pools, masked columns, head dims off the vector width), the dense panel
GEMMs at every row count, and RMSNorm; then the torch definitions' own claims (a sum in order is
one float32 add after another; exp stays within 2 ulp-scale of the true e^x)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hyloop.models.cpu import cpu_ops, numerics
from hyloop.models.cpu.kernel_choice import bf16_dot
from hyloop.models.cpu.panels import Panels

needs_kernels = pytest.mark.skipif(
    not cpu_ops.ensure_loaded(), reason="no C++ compiler: hyloop's CPU kernels cannot be built"
)


def _bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same shape and the same bits (NaNs aside, of which there are none here)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    a, b = got.contiguous().view(-1), want.contiguous().view(-1)
    diff = (
        a.view(torch.int16 if a.element_size() == 2 else torch.int32)
        != b.view(torch.int16 if b.element_size() == 2 else torch.int32)
    ).nonzero()
    assert diff.numel() == 0, (
        f"{diff.numel()} of {a.numel()} values differ; first at {int(diff[0])}: "
        f"{float(a[diff[0]])} vs {float(b[diff[0]])}"
    )


def _wide_values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)
    edges = torch.tensor(
        [0.0, -0.0, 1e-30, -1e-30, 87.0, 88.3, 88.37626, 88.5, -87.0, -87.33654, -87.4, -100.0]
    )
    return torch.cat([x, edges, torch.linspace(-90, 90, 4001)]).view(1, -1)


@needs_kernels
def test_exp_and_silu_are_the_kernels() -> None:
    x = _wide_values(20000, 0)
    _bits_equal(numerics.exp(x), torch.ops.hyloop.vector_math(x, 0))
    _bits_equal(numerics.silu(x), torch.ops.hyloop.vector_math(x, 1))


@needs_kernels
@pytest.mark.parametrize("n", [1, 15, 16, 17, 64, 100, 576, 1537])
def test_sum_of_squares_is_the_kernels(n: int) -> None:
    x = torch.randn(7, n, generator=torch.Generator().manual_seed(n)) * 3
    _bits_equal(numerics.lane_sum(x * x), torch.ops.hyloop.vector_math(x, 2))


def test_exp_is_accurate() -> None:
    x = torch.linspace(-80, 80, 100001)
    got = numerics.exp(x).double()
    want = torch.exp(x.double())
    assert float(((got - want) / want).abs().max()) < 1e-6
    assert float(numerics.exp(torch.tensor([-100.0]))) == 0.0


def test_a_sum_in_order_adds_one_after_another() -> None:
    t = torch.randn(50, 33, generator=torch.Generator().manual_seed(1)) * 1e3
    t[0] = -0.0
    acc = torch.zeros(33)
    for row in t:
        acc = acc + row
    _bits_equal(numerics.sum_in_order(t, 0), acc)


def _pool(dtype: torch.dtype, slots: int, hkv: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v = torch.randn(slots, hkv, d, generator=g).to(dtype)
    return k, v


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (9, 3, 64), (2, 1, 40), (3, 3, 16), (8, 1, 128)])
def test_attention_is_the_kernel(dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    g = torch.Generator().manual_seed(hq * 100 + d)
    b, length, slots = 5, 37, 128
    k_buf, v_buf = _pool(dtype, slots, hkv, d, hq + d)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    slot_ids = torch.randint(0, slots, (b, length), generator=g)
    bias = torch.where(torch.rand(b, length, generator=g) < 0.3, -torch.inf, 0.0)
    bias[:, 0] = 0.0  # every row sees a column
    bias[1] = torch.where(bias[1] == 0, torch.randn(length, generator=g), bias[1])  # a real bias
    scale = d**-0.5
    want = torch.ops.hyloop.decode_attention(q, k_buf, v_buf, slot_ids, bias, scale)
    _bits_equal(numerics.attention(q, k_buf, v_buf, slot_ids, bias, scale), want)
    _bits_equal(numerics.attention_op(q, k_buf, v_buf, slot_ids, bias, scale), want)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 7, 9, 33])
@pytest.mark.parametrize("n,k", [(64, 96), (37, 101), (48, 576)])
def test_dense_chain_is_the_panels(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    """The panels' vector tiles where the CPU has them, their portable loops elsewhere."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g).to(dtype)
    want = Panels.dense(w).linear(x, bias)
    _bits_equal(numerics.dense_linear(x, w, bias), want)
    _bits_equal(numerics.dense_op(x, w, None), Panels.dense(w).linear(x))


@needs_kernels
@pytest.mark.parametrize("fma", [False, True], ids=["vdpbf16ps", "float32"])
@pytest.mark.parametrize("rows", [1, 3, 9, 16, 33])
def test_both_bf16_paths_compute_the_chain(fma: bool, rows: int) -> None:
    """bfloat16 panels as vdpbf16ps and as float32 multiply-adds over the widened weights: the
    same bits, the reference's (the decoder stack reads the same path)."""
    g = torch.Generator().manual_seed(rows)
    spread = torch.exp(torch.randn(80, 576, generator=g))
    w = (torch.randn(80, 576, generator=g) * spread).bfloat16()
    x = (torch.randn(rows, 576, generator=g) * 4).bfloat16()
    bias = torch.randn(80, generator=g)
    try:
        assert cpu_ops.set_bf16_dot(fma) == fma or fma is False  # a build without vdpbf16ps
        _bits_equal(Panels.dense(w).linear(x, bias), numerics.dense_linear(x, w, bias))
        _bits_equal(Panels.dense(w).linear(x.float()), numerics.dense_linear(x.float(), w, None))
    finally:
        cpu_ops.set_bf16_dot(bf16_dot(cpu_ops.bf16_dot_times) == "fma")


def test_rms_norm_statistic_is_the_stated_one() -> None:
    h = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    ss = numerics.lane_sum(h * h)
    for r in range(3):
        lanes = torch.zeros(16)
        padded = torch.cat([h[r] * h[r], torch.zeros(12)]).view(-1, 16)
        for chunk in padded:
            lanes = lanes + chunk
        assert float(ss[r]) == float(numerics.tree16(lanes))
    got = numerics.rms_statistic(h, 1e-6).squeeze(-1)
    ms = ss.numpy() / np.float32(100.0) + np.float32(1e-6)
    want = torch.from_numpy(np.float32(1.0) / np.sqrt(ms))
    _bits_equal(got, want)
    assert math.isclose(
        float(got[0]), float(h[0].double().pow(2).mean().add(1e-6).rsqrt()), rel_tol=1e-6
    )


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_and_silu_kernels_are_the_definitions(
    dtype: torch.dtype, w_dtype: torch.dtype, zero_centered: bool
) -> None:
    from hyloop.models.layers.norm import _rms_norm

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 7, 576, generator=g) * 4).to(dtype)
    w = (torch.randn(576, generator=g) * 0.3 + 1).to(w_dtype)
    got = torch.ops.hyloop.rms_norm(x, w, 1e-5, zero_centered)  # the C++ kernel
    _bits_equal(got, _rms_norm(x, w, 1e-5, zero_centered))
    _bits_equal(torch.ops.hyloop.silu(x), numerics.silu(x))
