"""hyloop's panel GEMMs (``panels.h``, ``hyloop::panel_linear``): float32 and bfloat16 panels
against ``F.linear``, int4 / int8 panels against a float64 reference of their arithmetic (8-bit
activations per group of 32, integer dot products), a row's result the same alone, batched or
in a prefill, odd shapes, split (gate/up) panels, bad input, compiled calls, and the layers'
measured choice between them and torch's kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyloop.models.cpu import cpu_ops
from hyloop.models.cpu.kernel_choice import KernelTable, calibrate, calibrate_quantized
from hyloop.models.cpu.packed_linear import PackedLinear
from hyloop.models.cpu.panels import Panels
from hyloop.models.quant import Int4Linear, Int8Linear, int4_from_dense, int8_from_dense
from hyloop.models.quant.formats import Int4Groups, Int8Rows

pytestmark = pytest.mark.skipif(
    not cpu_ops.ensure_loaded(), reason="no C++ compiler: hyloop's CPU kernels cannot be built"
)


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    scale = float(ref.abs().max())
    torch.testing.assert_close(got.double(), ref.double(), rtol=0, atol=rel * scale)


def _q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the integer kernels do to activations: codes, scale and float sum per group of 32."""
    g = x.float().reshape(x.shape[0], -1, 32)
    d = g.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(g * inv[..., None]).double(), d.double(), g.sum(-1).double()


def _int4_reference(x: torch.Tensor, groups: Int4Groups) -> torch.Tensor:
    q, d, s = _q8(x)
    n, k = groups.codes.shape
    dot = torch.einsum("mgj,ngj->mng", q, groups.codes.double().view(n, k // 32, 32))
    scale, mins = groups.scale.double(), groups.min.double()
    return (dot * scale[None] * d[:, None] + mins[None] * s[:, None]).sum(-1)


def _int8_reference(x: torch.Tensor, rows: Int8Rows) -> torch.Tensor:
    q, d, _ = _q8(x)
    n, k = rows.codes.shape
    dot = torch.einsum("mgj,ngj->mng", q, rows.codes.double().view(n, k // 32, 32))
    return (dot * d[:, None]).sum(-1) * rows.scale.double()[None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 33])
@pytest.mark.parametrize("n,k", [(64, 96), (37, 100), (7, 9), (48, 1536)])
def test_dense_panels_are_the_linear(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g).to(dtype)
    got = Panels.dense(w).linear(x, bias)
    assert got.shape == (rows, n) and got.dtype == dtype
    ref = F.linear(x.double(), w.double(), bias.double())
    _close(got, ref, 1e-5 if dtype == torch.float32 else 8e-3)
    # A row's result does not depend on the rows beside it (every tile sums k in order).
    torch.testing.assert_close(Panels.dense(w).linear(x[-1:], bias), got[-1:], rtol=0, atol=0)


def test_dense_panels_keep_leading_dims() -> None:
    w = torch.randn(48, 32)
    x = torch.randn(2, 3, 32)
    got = Panels.dense(w).linear(x)
    assert got.shape == (2, 3, 48)
    _close(got, F.linear(x, w), 1e-5)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int4", "int8"])
def test_split_panels_return_the_weights_own_column_order(kind: str) -> None:
    """A fused gate/up projection's panels interleave its halves; the output does not."""
    torch.manual_seed(0)
    w = torch.randn(2 * 40, 64) * 0.1  # halves of 40 rows: a partial last panel in each
    x = torch.randn(5, 64)
    if kind in ("float32", "bfloat16"):
        dtype = getattr(torch, kind)
        plain, split = Panels.dense(w.to(dtype)), Panels.dense(w.to(dtype), split=40)
        xx = x.to(dtype)
    elif kind == "int4":
        groups = int4_from_dense(w)
        plain, split, xx = Panels.int4(groups), Panels.int4(groups, split=40), x
    else:
        rows = int8_from_dense(w)
        plain, split, xx = Panels.int8(rows), Panels.int8(rows, split=40), x
    torch.testing.assert_close(split.linear(xx), plain.linear(xx), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 33])
@pytest.mark.parametrize("k", [192, 96, 32])
def test_int4_panels_are_their_integer_arithmetic(rows: int, k: int) -> None:
    torch.manual_seed(rows)
    n = 80
    groups = int4_from_dense(torch.randn(n, k) * 0.05)
    x = torch.randn(rows, k)
    p = Panels.int4(groups)
    got = p.linear(x)
    _close(got, _int4_reference(x, groups), 1e-6)
    _close(got, F.linear(x, groups.dequantize()), 2e-2)  # and near the float product
    torch.testing.assert_close(p.linear(x[-1:]), got[-1:], rtol=0, atol=0)


def test_int4_scales_exact_in_fp16_are_stored_so_and_others_in_fp32() -> None:
    """A GGUF file's Q4_0 / Q4_1 scales and minimums are fp16: stored as such (a quarter fewer
    bytes to stream); any other value keeps float32."""
    torch.manual_seed(1)
    g = int4_from_dense(torch.randn(32, 64))
    fp16 = Int4Groups(g.codes, g.scale.half().float(), g.min.half().float())
    odd = Int4Groups(g.codes, fp16.scale * (1 + 2**-20), fp16.min)
    assert Panels.int4(fp16).half and not Panels.int4(odd).half
    assert Panels.int4(fp16).nbytes < Panels.int4(odd).nbytes
    x = torch.randn(3, 64)
    _close(Panels.int4(fp16).linear(x), _int4_reference(x, fp16), 1e-6)
    x = torch.randn(3, 64)
    _close(Panels.int4(odd).linear(x), _int4_reference(x, odd), 1e-6)


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("k", [96, 576])
def test_int8_panels_are_their_integer_arithmetic(rows: int, k: int) -> None:
    torch.manual_seed(rows + k)
    r8 = int8_from_dense(torch.randn(70, k) * 0.05)
    x = torch.randn(rows, k)
    got = Panels.int8(r8).linear(x)
    _close(got, _int8_reference(x, r8), 1e-6)
    _close(got, F.linear(x, r8.dequantize()), 2e-2)


def test_bf16_activations_on_integer_panels() -> None:
    torch.manual_seed(2)
    groups = int4_from_dense(torch.randn(64, 128) * 0.05)
    x = torch.randn(4, 128).bfloat16()
    got = Panels.int4(groups).linear(x)
    assert got.dtype == torch.bfloat16
    _close(got, _int4_reference(x.float(), groups), 8e-3)


def test_bad_input_is_named() -> None:
    p = Panels.dense(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="columns"):
        p.linear(torch.randn(2, 31))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        p.linear(torch.randn(2, 32).half())
    with pytest.raises(RuntimeError, match="whole groups of 32"):
        torch.ops.hyloop.pack_panels_i4(
            torch.zeros(16, 40, dtype=torch.uint8), torch.ones(16, 1), torch.ones(16, 1), 0, True
        )
    with pytest.raises(RuntimeError, match="split"):
        Panels.dense(torch.randn(15, 32), split=8)
    with pytest.raises(RuntimeError, match="bytes"):
        torch.ops.hyloop.panel_linear(torch.randn(1, 32), p.data[:-1], 0, 16, 32, 0, False, None)


def test_compiled_calls_equal_eager() -> None:
    torch.manual_seed(0)
    dense = PackedLinear(nn.Linear(256, 128).bfloat16(), panels=True)
    dense.set_kernels({1: "tiled", 4: "tiled"})
    q4 = Int4Linear(int4_from_dense(torch.randn(64, 128)))
    q4.attach_panels()
    q4.set_kernels({4: "tiled"})

    def step(x: torch.Tensor) -> torch.Tensor:
        return q4(dense(x).float() * 2 - 1)

    x = torch.randn(4, 256).bfloat16()
    with torch.inference_mode():
        eager = step(x)
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_quantized_layers_run_one_measured_kernel_at_every_row_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernels round activations differently, so a row's result must not depend on how
    many rows share the call: one kernel for all."""
    layer = Int4Linear(int4_from_dense(torch.randn(64, 128)))
    layer.attach_panels()
    calls: list[str] = []
    monkeypatch.setattr(layer, "tiled", lambda x: calls.append("tiled") or x.new_zeros(len(x), 64))
    monkeypatch.setattr(layer, "matmul", lambda x: calls.append("aten") or x.new_zeros(len(x), 64))
    layer(torch.randn(3, 128))
    assert calls == ["aten"]  # unmeasured: torch's
    layer.set_kernels({1: "tiled", 16: "tiled"})
    for rows in (1, 8, 200):  # 200: above every measured count (a prefill chunk)
        layer(torch.randn(rows, 128))
    assert calls == ["aten", "tiled", "tiled", "tiled"]
    assert layer.nbytes == layer.panels.nbytes
    with pytest.raises(ValueError, match="one kernel for every row count"):
        layer.set_kernels({1: "tiled", 16: "aten"})


def test_a_chosen_kernel_keeps_one_copy_of_the_weight(tmp_path) -> None:  # noqa: ANN001
    """Once its kernel is chosen, a weight-only layer drops the copy only the other kernel
    reads (torch's packed codes, or panels no decoder stack needs); its output does not move,
    and no later choice can pick the dropped kernel."""
    torch.manual_seed(0)
    q4 = Int4Linear(int4_from_dense(torch.randn(64, 128)))
    q4.attach_panels()
    x = torch.randn(5, 128)
    assert q4.release_unused(keep_panels=False) == 0  # unmeasured: nothing is dropped
    q4.set_kernels({1: "tiled", 4: "tiled"})
    before = q4(x)
    aten_bytes = sum(b.numel() * b.element_size() for b in q4.aten_buffers())
    assert q4.release_unused(keep_panels=False) == aten_bytes > 0
    assert q4.packed is None and q4.scales_zeros is None and q4.panels is not None
    assert {name for name, _ in q4.named_buffers()} == {"panel_data"}
    torch.testing.assert_close(q4(x), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="aten copy was released"):
        q4.set_kernels({1: "aten"})
    # A later calibration (another engine over the same model) measures only what is left.
    calibrate_quantized([q4], [1, 8], table=KernelTable.load(tmp_path))
    assert {k for _, k in q4.kernels} == {"tiled"}
    torch.testing.assert_close(q4(x), before, rtol=0, atol=0)

    q8 = Int8Linear(int8_from_dense(torch.randn(64, 128)))
    q8.attach_panels()
    q8.set_kernels({1: "aten", 4: "aten"})
    before = q8(x)
    assert q8.release_unused(keep_panels=True) == 0  # a decoder stack reads the panels
    assert q8.panels is not None
    panel_bytes = q8.panels.nbytes
    assert q8.release_unused(keep_panels=False) == panel_bytes > 0
    assert q8.panels is None and q8.panel_data is None
    torch.testing.assert_close(q8(x), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="tiled copy was released"):
        q8.set_kernels({1: "tiled"})


def test_dense_panels_no_kernel_reads_are_dropped(tmp_path) -> None:  # noqa: ANN001
    """A dense layer keeps its panels only where a row count runs them or a decoder stack reads
    them; once dropped, no later choice offers them, however fast the table says they were."""
    torch.manual_seed(0)
    layer = PackedLinear(nn.Linear(512, 256), panels=True)
    assert layer.release_unused(keep_panels=False) == 0  # unmeasured
    x = torch.randn(3, 512)
    layer.set_kernels({1: "tiled", 4: "packed"})
    assert layer.release_unused(keep_panels=False) == 0  # one row runs them
    layer.set_kernels({1: "packed", 4: "linear"})
    before = layer(x)
    assert layer.release_unused(keep_panels=True) == 0  # a stack reads them
    panel_bytes = layer.panel_data.numel() * layer.panel_data.element_size()
    assert layer.release_unused(keep_panels=False) == panel_bytes > 0
    assert layer.panels is None and layer.panel_data is None
    torch.testing.assert_close(layer(x), before, rtol=0, atol=0)
    table = KernelTable.load(tmp_path)
    table.entries["float32 256x512"] = {
        r: {"linear": 100.0, "packed": 90.0, "tiled": 1.0} for r in (1, 4)
    }
    calibrate([layer], [1, 4], with_gemv=False, tiled=True, table=table)
    assert dict(layer.kernels) == {1: "packed", 4: "packed"}
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_panels_are_attached_once_and_need_whole_groups() -> None:
    q4 = Int4Linear(int4_from_dense(torch.randn(32, 64)))
    with pytest.raises(RuntimeError, match="attach_panels"):
        q4.tiled(torch.randn(1, 64))
    q4.attach_panels()
    first = q4.panels
    q4.attach_panels()
    assert q4.panels is first
    q8 = Int8Linear(int8_from_dense(torch.randn(32, 48)))  # 48: not whole groups of 32
    q8.attach_panels()
    assert q8.panels is None and q8.tiled_buffers() == ()


@pytest.mark.parametrize("k", [128, 96])
def test_a_prefix_hit_does_not_change_a_quantized_rows_result(k: int) -> None:
    """The same row alone, in a batch and in a long prefill chunk: the same output (two kernels
    would differ by their activations' rounding)."""
    layer = Int4Linear(int4_from_dense(torch.randn(64, k)))
    layer.attach_panels()
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
    every Linear, dense and quantized, runs torch's (or oneDNN's) instead; unslowed, the same
    layers take hyloop's somewhere (so the test can fail)."""
    torch.manual_seed(0)

    def layers() -> tuple[list[PackedLinear], list[Int8Linear]]:
        dense = [PackedLinear(nn.Linear(512, 512), panels=True) for _ in range(2)]
        quant = [Int8Linear(int8_from_dense(torch.randn(512, 512)))]
        quant[0].attach_panels()
        return dense, quant

    dense, quant = layers()
    table = calibrate(dense, [1, 4], with_gemv=False, tiled=True, table=KernelTable.load(tmp_path))
    calibrate_quantized(quant, [1, 4], table=table)
    fast = [k for _, k in dense[0].kernels] + [k for _, k in quant[0].kernels]
    assert "tiled" in fast, fast

    monkeypatch.setattr(Panels, "linear", _slow(Panels.linear))
    monkeypatch.setattr(Int8Linear, "tiled", _slow(Int8Linear.tiled))
    dense, quant = layers()
    slow_dir = tmp_path / "slowed"
    table = calibrate(dense, [1, 4], with_gemv=False, tiled=True, table=KernelTable.load(slow_dir))
    calibrate_quantized(quant, [1, 4], table=table)
    assert set(table.entries["float32 512x512"][4]) >= {"linear", "tiled"}
    assert all(k != "tiled" for _, k in dense[0].kernels), dense[0].kernels
    assert all(k == "aten" for _, k in quant[0].kernels), quant[0].kernels
