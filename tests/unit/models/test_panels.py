"""hyloop's panel GEMMs (``panels.h``, ``hyloop::panel_linear``): float32 and bfloat16 panels
against ``F.linear``, int4 / int8 panels against a float64 reference of their arithmetic (16-bit
activations per group of 32, integer dot products), a row's result the same alone, batched or
in a prefill, odd shapes, split (gate/up) panels, bad input, compiled calls, and the layers
holding their weight once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyloop.models.cpu import cpu_ops, kernel_choice
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
    """What the integer kernels do to activations: codes, scale and the sum the codes hold
    (scale * code sum) per group of 32."""
    g = x.float().reshape(x.shape[0], -1, 32)
    d = g.abs().amax(-1) / 32512
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(g * inv[..., None])
    return q.double(), d.double(), (d * q.sum(-1)).double()


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


@pytest.mark.parametrize("kind", ["int4", "int4-fp32-scales", "int8"])
@pytest.mark.parametrize("rows", [12, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_integer_panels_on_amx_tiles_keep_the_vector_tiles_bits(
    kind: str, rows: int, dtype: torch.dtype
) -> None:
    """Where the CPU has AMX, integer GEMMs of 12 rows or more run on tiles (exact integer
    dots, the same chain after them): the vector tiles' bits."""
    if not cpu_ops.set_amx(True):
        pytest.skip("no AMX tiles here (CPU, Linux or build): only the vector tiles run")
    assert {"amx_tile", "amx_int8"} <= kernel_choice.cpu_flags()
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 576, generator=g) * 0.05
    if kind == "int8":
        p = Panels.int8(int8_from_dense(w))
    else:
        groups = int4_from_dense(w)
        if kind == "int4":  # a GGUF file's fp16 scales and minimums
            groups = Int4Groups(
                groups.codes, groups.scale.half().float(), groups.min.half().float()
            )
        p = Panels.int4(groups)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    try:
        cpu_ops.set_amx(False)
        vectors = p.linear(x)
    finally:
        cpu_ops.set_amx(True)
    tiles = p.linear(x)
    assert torch.equal(
        tiles.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        vectors.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )


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
    dense = PackedLinear(nn.Linear(256, 128).bfloat16(), "tiled")
    q4 = Int4Linear(int4_from_dense(torch.randn(64, 128)))
    q4.attach_panels()

    def step(x: torch.Tensor) -> torch.Tensor:
        return q4(dense(x).float() * 2 - 1)

    x = torch.randn(4, 256).bfloat16()
    with torch.inference_mode():
        eager = step(x)
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_panels_replace_the_reference_copy_of_the_weight() -> None:
    """Once its panels exist a weight-only layer holds its weight once (the codes the torch
    reference read are dropped), and computes the reference's bits."""
    torch.manual_seed(0)
    x = torch.randn(5, 128)
    for layer in (
        Int4Linear(int4_from_dense(torch.randn(64, 128)), torch.randn(64)),
        Int8Linear(int8_from_dense(torch.randn(64, 128))),
    ):
        before = layer(x)
        assert layer.kernel == "reference" and layer.nbytes > 0
        layer.attach_panels()
        assert layer.kernel == "panels"
        assert {name for name, _ in layer.named_buffers()} == {"panel_data"}
        assert layer.nbytes == layer.panels.nbytes
        assert torch.equal(layer(x), before)
        first = layer.panels
        layer.attach_panels()
        assert layer.panels is first  # once


def test_live_rows_alone_are_computed_with_their_bits() -> None:
    """``live`` (a verify step's real positions): those rows computed, bit for bit what they are
    with every row computed, the others zeros; a layer on the reference computes every row."""
    torch.manual_seed(0)
    x = torch.randn(7, 128)
    live = torch.tensor([True, False, True, True, False, False, True])
    for layer in (
        Int4Linear(int4_from_dense(torch.randn(64, 128)), torch.randn(64)),
        Int8Linear(int8_from_dense(torch.randn(64, 128))),
    ):
        assert not layer.skips_rows
        reference = layer(x, live=live)
        layer.attach_panels()
        assert layer.skips_rows
        every, some = layer(x), layer(x, live=live)
        assert torch.equal(every, reference)
        assert torch.equal(some[live], every[live])
        assert not some[~live].any() and every[~live].all()
        # bfloat16 rows: the live rows' rounded outputs in their places too
        every, some = layer(x.bfloat16()), layer(x.bfloat16(), live=live)
        assert some.dtype == torch.bfloat16 and torch.equal(some[live], every[live])
        assert not some[~live].any() and every[~live].all()


def test_int8_needs_whole_groups() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        Int8Linear(int8_from_dense(torch.randn(32, 48)))


@pytest.mark.parametrize("k", [128, 96])
def test_a_prefix_hit_does_not_change_a_quantized_rows_result(k: int) -> None:
    """The same row alone, in a batch and in a long prefill chunk: the same output."""
    layer = Int4Linear(int4_from_dense(torch.randn(64, k)))
    layer.attach_panels()
    rows = torch.randn(300, k)
    whole = layer(rows)
    torch.testing.assert_close(layer(rows[:1]), whole[:1], rtol=0, atol=0)
    torch.testing.assert_close(layer(rows[5:9]), whole[5:9], rtol=0, atol=0)
    for n in range(1, 18):  # every row block shape (one row, 4 x 2, 8 and the rest, tiles)
        torch.testing.assert_close(layer(rows[:n]), whole[:n], rtol=0, atol=0)
