"""The quantized modes' definition (``quant.reference``): near an independent float64 reading of
its arithmetic, the same bits at every row count and in a compiled step, and hyloop's panels
and decoder-stack GEMMs equal to it bit for bit (every row count, float32 and bfloat16 rows,
fp16 and fp32 scales, a bias, odd shapes)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from hyloop.models.cpu import cpu_ops
from hyloop.models.quant import Int4Linear, Int8Linear, int4_from_dense, int8_from_dense
from hyloop.models.quant.formats import Int4Groups
from hyloop.models.quant.reference import fma, quantize_activations

native = pytest.mark.skipif(
    not cpu_ops.ensure_loaded(), reason="no C++ compiler: hyloop's CPU kernels cannot be built"
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _float64_reading(x: torch.Tensor, groups: Int4Groups) -> torch.Tensor:
    """The same arithmetic in float64 with torch's own reductions (an independent reading)."""
    g = x.double().reshape(x.shape[0], -1, 32)
    d = g.abs().amax(-1) / 32512
    q = torch.round(g / torch.where(d > 0, d, torch.ones_like(d))[..., None])
    n, k = groups.codes.shape
    dots = torch.einsum("mgj,ngj->mng", q, groups.codes.double().view(n, k // 32, 32))
    scale, mins = groups.scale.double(), groups.min.double()
    return (dots * scale[None] * d[:, None] + mins[None] * (d * q.sum(-1))[:, None]).sum(-1)


def test_the_reference_is_its_stated_arithmetic() -> None:
    torch.manual_seed(0)
    groups = int4_from_dense(torch.randn(48, 192) * 0.05)
    x = torch.randn(7, 192) * 3
    got = Int4Linear(groups).reference(x)
    want = _float64_reading(x, groups)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * float(want.abs().max()))


def test_activation_codes_are_16_bit_per_group_and_zero_groups_stay_zero() -> None:
    x = torch.randn(3, 96)
    x[1, 32:64] = 0
    codes, scale, fsum = quantize_activations(x)
    assert codes.abs().max() <= 32512 and torch.equal(codes, codes.round())
    assert scale[1, 1] == 0 and torch.all(codes[1, 1] == 0) and fsum[1, 1] == 0
    assert torch.equal(codes.abs().amax(-1)[scale > 0], torch.full_like(scale[scale > 0], 32512))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_reference_gives_a_row_the_same_bits_alone_batched_and_compiled(kind: str) -> None:
    torch.manual_seed(1)
    w = torch.randn(64, 128) * 0.05
    layer = Int4Linear(int4_from_dense(w)) if kind == "int4" else Int8Linear(int8_from_dense(w))
    x = torch.randn(40, 128)
    with torch.inference_mode():
        whole = layer(x)
        for rows in (1, 2, 9, 33):
            assert torch.equal(layer(x[:rows]), whole[:rows])
        compiled = torch.compile(lambda t: layer(t) * 1, fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x[:4]), whole[:4])


def _layers(n: int, k: int, fp16_scales: bool) -> list[Int4Linear | Int8Linear]:
    w = torch.randn(n, k) * 0.05
    groups = int4_from_dense(w)
    if fp16_scales:
        groups = Int4Groups(groups.codes, groups.scale.half().float(), groups.min.half().float())
    return [Int4Linear(groups, torch.randn(n)), Int8Linear(int8_from_dense(w))]


@native
@pytest.mark.parametrize("n,k,fp16", [(64, 64, True), (576, 576, False), (48, 1536, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_panels_are_the_reference_bit_for_bit(
    n: int, k: int, fp16: bool, dtype: torch.dtype
) -> None:
    torch.manual_seed(n + k)
    for ref_layer in _layers(n, k, fp16):
        panel_layer = Int4Linear.__new__(type(ref_layer))
        panel_layer.__dict__ = {**ref_layer.__dict__}
        panel_layer._buffers = dict(ref_layer._buffers)
        panel_layer._modules = dict(ref_layer._modules)
        panel_layer._parameters = dict(ref_layer._parameters)
        panel_layer.attach_panels()
        for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64):
            x = (torch.randn(rows, k) * torch.rand(rows, 1) * 4).to(dtype)
            x[0, :32] = 0  # an all-zero group
            with torch.inference_mode():
                want = ref_layer.reference(x)
                got = panel_layer(x)
            assert got.dtype == dtype
            assert torch.equal(_bits(got), _bits(want)), (type(ref_layer).__name__, rows)


def _round_to_float32(x: Fraction) -> float:
    """The float32 nearest ``x`` (ties to even), by exact comparison with its two neighbours."""
    near = np.float32(float(x))
    down, up = np.float32(-np.inf), np.float32(np.inf)
    cands = [np.nextafter(near, down), near, np.nextafter(near, up)]

    def distance(c: np.float32) -> tuple[Fraction, int]:
        return abs(Fraction(float(c)) - x), int(np.float32(c).view(np.int32)) & 1

    return float(min(cands, key=distance))


def test_fma_rounds_once_where_float64_would_round_twice() -> None:
    """``fma`` against exact rational arithmetic: random operands, and sums built to land where
    rounding to float64 first and then to float32 gives the wrong neighbour."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4000, generator=g) * 2.0 ** torch.randint(-20, 20, (4000,), generator=g)
    b = torch.randn(4000, generator=g)
    c = torch.randn(4000, generator=g) * 2.0 ** torch.randint(-20, 20, (4000,), generator=g)
    # c = 1 + 2**-23 (an odd float32), a * b = 2**-24 - 2**-60: the exact sum lies just below
    # the midpoint to the next float32; float64 rounds it onto the midpoint, and the tie then
    # goes to the even neighbour above (the fused result stays at c). Both signs.
    tricky_a = torch.tensor([1 + 2.0**-18, -(1 + 2.0**-18)], dtype=torch.float32)
    tricky_b = torch.tensor([2.0**-24 * (1 - 2.0**-18)] * 2, dtype=torch.float32)
    tricky_c = torch.tensor([1 + 2.0**-23, -(1 + 2.0**-23)], dtype=torch.float32)
    twice = (tricky_a.double() * tricky_b.double() + tricky_c.double()).float()
    assert not torch.equal(twice, tricky_c)  # the case is real: rounding twice moves it
    a, b, c = torch.cat([a, tricky_a]), torch.cat([b, tricky_b]), torch.cat([c, tricky_c])
    got = fma(a, b, c)
    for x, y, z, r in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist(), strict=True):
        assert r == _round_to_float32(Fraction(x) * Fraction(y) + Fraction(z)), (x, y, z)
