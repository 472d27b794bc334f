"""Moving cached keys to new positions: one turn by the table's angle difference equals RoPE
applied at the new position, for both pair layouts and partial rotary."""

from __future__ import annotations

import pytest
import torch

from hyloop.models.kv_shift import KVShifter, rotate_keys
from hyloop.models.layers.rope import RopeSpec


def rope_ref(
    x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, layout: str
) -> torch.Tensor:
    """RoPE at ``pos`` from an fp32 cos/sin table, written out pair by pair."""
    rd = 2 * inv_freq.numel()
    ang = torch.outer(pos.float(), inv_freq.float()).unsqueeze(1)
    cos, sin = ang.cos(), ang.sin()
    out = x.clone()
    for j in range(rd // 2):
        i0, i1 = (j, j + rd // 2) if layout == "neox" else (2 * j, 2 * j + 1)
        a, b = x[..., i0], x[..., i1]
        out[..., i0] = a * cos[..., j] - b * sin[..., j]
        out[..., i1] = b * cos[..., j] + a * sin[..., j]
    return out


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize(
    "spec",
    [
        RopeSpec(theta=10000.0, rotary_dim=32),
        RopeSpec(theta=10000.0, rotary_dim=16),  # partial rotary: dims 16..31 pass through
        RopeSpec(theta=500000.0, rotary_dim=32, rope_type="linear", factor=4.0),
        RopeSpec(
            theta=500000.0, rotary_dim=32, rope_type="llama3", factor=8.0, original_max_position=64
        ),
    ],
    ids=["default", "partial", "linear", "llama3"],
)
def test_moved_key_equals_rope_at_the_new_position(spec: RopeSpec, layout: str) -> None:
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(500, 2, 32, generator=g)
    old = torch.randint(0, 4000, (500,), generator=g)
    new = torch.randint(0, 4000, (500,), generator=g)
    inv = spec.inv_freq()
    moved = rotate_keys(rope_ref(raw, old, inv, layout), old, new, inv, layout)
    want = rope_ref(raw, new, inv, layout)
    torch.testing.assert_close(moved, want, atol=1e-5, rtol=0)
    if spec.rotary_dim < 32:
        assert torch.equal(moved[..., spec.rotary_dim :], raw[..., spec.rotary_dim :])


def test_shifts_it_cannot_do_exactly_are_refused() -> None:
    with pytest.raises(ValueError, match="'dynamic' cannot be shifted"):
        KVShifter(RopeSpec(theta=10000.0, rotary_dim=32, rope_type="dynamic"))
    with pytest.raises(ValueError, match="layout"):
        rotate_keys(torch.zeros(1, 1, 4), torch.zeros(1), torch.ones(1), torch.ones(2), "mrope")  # type: ignore[arg-type]


def test_copy_shifted_moves_v_and_turns_k_in_every_layer() -> None:
    spec = RopeSpec(theta=10000.0, rotary_dim=8)
    shifter = KVShifter(spec)
    g = torch.Generator().manual_seed(1)
    k = [torch.randn(20, 1, 8, generator=g) for _ in range(2)]
    v = [torch.randn(20, 1, 8, generator=g) for _ in range(2)]
    before = [t.clone() for t in k]
    src, dst = torch.tensor([1, 2, 3]), torch.tensor([10, 11, 12])
    shifter.copy_shifted(k, v, src, dst, torch.tensor([5, 6, 7]), torch.tensor([9, 10, 11]))
    for layer in range(2):
        assert torch.equal(v[layer][dst], v[layer][src])
        turned = rotate_keys(
            before[layer][src], torch.tensor([5, 6, 7]), torch.tensor([9, 10, 11]), spec.inv_freq()
        )
        assert torch.equal(k[layer][dst], turned)
        assert torch.equal(k[layer][:10], before[layer][:10])  # nothing else written
