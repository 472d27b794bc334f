"""hyloop's few-row GEMMs (``cpu_gemm.cpp``): the dense one against ``F.linear`` for float32 and
bfloat16 weights, the int4 / int8 ones against a float matmul over the dequantized weight (their
activations are 8-bit per group of 32 on AVX2, so within that rounding), odd shapes, bad input,
compiled calls, and the layers' measured choice between them and torch's kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyloop.models.cpu import cpu_ops
from hyloop.models.cpu.kernel_choice import KernelTable, calibrate, calibrate_quantized
from hyloop.models.cpu.packed_linear import PackedLinear
from hyloop.models.quant import Int4Linear, Int8Linear, int4_from_dense, int8_from_dense

pytestmark = pytest.mark.skipif(
    not cpu_ops.ensure_loaded(), reason="no C++ compiler: hyloop's CPU kernels cannot be built"
)


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    scale = float(ref.abs().max())
    torch.testing.assert_close(got, ref, rtol=0, atol=rel * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 33])
@pytest.mark.parametrize("n,k", [(64, 96), (37, 100), (7, 9)])
def test_small_gemm_is_the_linear(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    got = torch.ops.hyloop.small_gemm(x, w, bias)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    _close(got, F.linear(x, w.float(), bias), 1e-5)  # float32 math on the weight's values


def test_small_gemm_keeps_leading_dims_and_the_activation_dtype() -> None:
    w = torch.randn(48, 32)
    x = torch.randn(2, 3, 32).bfloat16()
    got = torch.ops.hyloop.small_gemm(x, w, None)
    assert got.shape == (2, 3, 48) and got.dtype == torch.bfloat16
    _close(got.float(), F.linear(x.float(), w), 1e-2)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 33])
@pytest.mark.parametrize("n,k", [(64, 96), (37, 100), (9, 7), (24, 1536)])
def test_bf16_rows_on_bf16_weights(rows: int, n: int, k: int) -> None:
    """bfloat16 activations on bfloat16 weights (vdpbf16ps where the CPU has AVX-512 BF16):
    exact products, float32 sums, one bfloat16 rounding of the output; a row's result is the
    same alone as in a batch (every tile shape sums a row in the same order)."""
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    got = torch.ops.hyloop.small_gemm(x, w, bias)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    _close(got.float(), F.linear(x.float(), w.float(), bias), 8e-3)
    alone = torch.ops.hyloop.small_gemm(x[-1:], w, bias)
    torch.testing.assert_close(alone, got[-1:], rtol=0, atol=0)


def _q8(x: torch.Tensor) -> torch.Tensor:
    """What the AVX2 kernels do to activations: int8 per group of 32, one scale per group."""
    g = x.reshape(*x.shape[:-1], -1, 32)
    d = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / torch.where(d > 0, d, 1)) * d).reshape(x.shape)


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("k", [192, 96])  # 6 and 3 groups (the VNNI tile pairs groups)
def test_int4_gemm_is_the_dequantized_matmul(rows: int, k: int) -> None:
    torch.manual_seed(rows)
    w, bias = torch.randn(80, k) * 0.05, torch.randn(80) * 0.1
    layer = Int4Linear(int4_from_dense(w), bias)
    x = torch.randn(rows, k)
    got = layer.tiled(x)
    groups = int4_from_dense(w)
    dense = groups.dequantize()
    # The codes' dot products are exact integers: only the activations' rounding differs from
    # a float32 matmul, and it is what the reference models (or none, off AVX2). The minimum
    # term reads the float32 sum of each group of x.
    n, k = groups.codes.shape
    coded = (groups.codes.float().view(n, k // 32, 32) * groups.scale[..., None]).view(n, k)
    ref_q8 = F.linear(_q8(x), coded, bias) + F.linear(x, dense - coded)
    ref = F.linear(x, dense, bias)
    assert got.shape == (rows, 80)
    err_q8, err = (got - ref_q8).abs().max(), (got - ref).abs().max()
    assert min(float(err_q8), float(err)) <= 1e-4 * float(ref.abs().max())
    _close(got, ref, 2e-2)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("k", [96, 48])  # 48: not whole groups of 32, the float path
def test_int8_gemm_is_the_dequantized_matmul(rows: int, k: int) -> None:
    torch.manual_seed(rows + k)
    w = torch.randn(70, k) * 0.05
    r8 = int8_from_dense(w)
    layer = Int8Linear(r8)
    x = torch.randn(rows, k)
    got = layer.tiled(x)
    ref = F.linear(x, r8.dequantize())
    ref_q8 = F.linear(_q8(x), r8.dequantize()) if k % 32 == 0 else ref
    err = min(float((got - ref_q8).abs().max()), float((got - ref).abs().max()))
    assert err <= 1e-4 * float(ref.abs().max())
    _close(got, ref, 2e-2)


def test_bad_input_is_named() -> None:
    w = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.hyloop.small_gemm(torch.randn(2, 31), w, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.hyloop.small_gemm(torch.randn(2, 32), w.half(), None)
    layer = Int4Linear(int4_from_dense(torch.randn(16, 64)))
    with pytest.raises(RuntimeError, match="groups of 32"):
        torch.ops.hyloop.int4_gemm(torch.randn(1, 32), layer.nibbles, layer.scale, layer.mins, None)


def test_compiled_calls_equal_eager() -> None:
    torch.manual_seed(0)
    dense = PackedLinear(nn.Linear(256, 128).bfloat16())
    dense.set_kernels({1: "tiled", 4: "tiled"})
    q4 = Int4Linear(int4_from_dense(torch.randn(64, 128)))
    q4.set_kernels({4: "tiled"})

    def step(x: torch.Tensor) -> torch.Tensor:
        return q4(dense(x).float() * 2 - 1)

    x = torch.randn(4, 256).bfloat16()
    with torch.inference_mode():
        eager = step(x)
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_quantized_layers_run_one_measured_kernel_at_every_row_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernels round activations differently, so a row's result must not depend on how
    many rows share the call: one kernel for all."""
    layer = Int4Linear(int4_from_dense(torch.randn(64, 128)))
    calls: list[str] = []
    monkeypatch.setattr(layer, "tiled", lambda x: calls.append("tiled") or x.new_zeros(len(x), 64))
    monkeypatch.setattr(layer, "matmul", lambda x: calls.append("aten") or x.new_zeros(len(x), 64))
    layer(torch.randn(3, 128))
    assert calls == ["aten"]  # unmeasured: torch's
    layer.set_kernels({1: "tiled", 16: "tiled"})
    for rows in (1, 8, 200):  # 200: above every measured count (a prefill chunk)
        layer(torch.randn(rows, 128))
    assert calls == ["aten", "tiled", "tiled", "tiled"]
    assert layer.nbytes == sum(b.numel() * b.element_size() for b in layer.tiled_buffers())
    with pytest.raises(ValueError, match="one kernel for every row count"):
        layer.set_kernels({1: "tiled", 16: "aten"})


@pytest.mark.parametrize("k", [128, 96])
def test_a_prefix_hit_does_not_change_a_quantized_rows_result(k: int) -> None:
    """The same row alone, in a batch and in a long prefill chunk: the same output, to float32
    summation order (two kernels would differ by their activations' rounding, ~1000x more)."""
    layer = Int4Linear(int4_from_dense(torch.randn(64, k)))
    layer.set_kernels({1: "tiled", 4: "tiled"})
    rows = torch.randn(300, k)
    whole = layer(rows)
    tol = 1e-5 * float(whole.abs().max())
    torch.testing.assert_close(layer(rows[:1]), whole[:1], rtol=0, atol=0)
    torch.testing.assert_close(layer(rows[5:9]), whole[5:9], rtol=0, atol=0)
    other = layer.matmul(rows.bfloat16()).float()  # torch's kernel on the same rows
    assert float((other - whole).abs().max()) > 100 * tol


def _slow(real):  # noqa: ANN001, ANN202
    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real(*args, **kwargs)
        for _ in range(30):  # the same product, computed 30 more times
            real(*args, **kwargs)
        return out

    return run


def test_a_slowed_tiled_kernel_is_not_chosen(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The measured choice never keeps a slower kernel: with hyloop's GEMMs made ~30x slower
    every Linear, dense and quantized, runs torch's (or oneDNN's) instead."""
    import hyloop.models.cpu.kernel_choice as kc

    torch.manual_seed(0)
    dense = [PackedLinear(nn.Linear(512, 512)) for _ in range(2)]
    quant = [Int8Linear(int8_from_dense(torch.randn(512, 512)))]
    slow_gemm = _slow(torch.ops.hyloop.small_gemm)
    monkeypatch.setattr(kc.torch.ops.hyloop, "small_gemm", slow_gemm, raising=False)
    monkeypatch.setattr(Int8Linear, "tiled", _slow(Int8Linear.tiled))
    table = calibrate(dense, [1, 4], with_gemv=False, tiled=True, table=KernelTable.load(tmp_path))
    calibrate_quantized(quant, [1, 4], table=table)
    assert set(table.entries["float32 512x512"][4]) >= {"linear", "tiled"}
    assert all(k != "tiled" for _, k in dense[0].kernels), dense[0].kernels
    assert all(k == "aten" for _, k in quant[0].kernels), quant[0].kernels
