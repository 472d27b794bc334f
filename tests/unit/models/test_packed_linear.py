"""Pre-packed oneDNN Linear: same results as ``F.linear``, eager and inside torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import BF16_PACKED
from torch import nn
from torch._inductor.decomposition import decompositions as inductor_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from hyloop.models.cpu.packed_linear import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu")), reason="oneDNN is not available in this build"
)


@pytest.mark.parametrize("dtype", [torch.float32, BF16_PACKED])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(dtype: torch.dtype, bias: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(256, 384, bias=bias).to(dtype)
    packed = PackedLinear(lin, "packed")
    for shape in [(1, 256), (5, 256), (16, 256), (3, 7, 256)]:
        x = torch.randn(shape, dtype=dtype)
        ref = F.linear(
            x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float()
        )
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(packed(x).float(), ref, atol=tol, rtol=tol)


def test_pack_linears_keeps_names_and_skips_small_layers() -> None:
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))
    names = [n for n, _ in model.named_parameters()]
    assert pack_linears(model, lambda dtype: "packed") == 1  # the 512x8 head is too small
    assert [n for n, _ in model.named_parameters()] == names
    assert isinstance(model[0], PackedLinear) and type(model[2]) is nn.Linear


def test_compiled_step_calls_the_packed_op() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(512, 256)
    packed = PackedLinear(lin, "packed")
    x = torch.randn(4, 512)
    step = torch.compile(lambda t: torch.relu(packed(t)) * 2, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        torch.testing.assert_close(step(x), torch.relu(lin(x)) * 2, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, BF16_PACKED])
def test_a_compiled_single_row_runs_the_eager_kernel(dtype: torch.dtype) -> None:
    """Batch-1 decode: the compiled step calls the layer's one kernel (no multiply-reduce of
    its own, whose summation order would differ), so its bits are the eager step's."""
    torch.manual_seed(2)
    packed = PackedLinear(nn.Linear(512, 256).to(dtype), "packed")
    x = torch.randn(1, 1, 512, dtype=dtype)
    gm = make_fx(lambda t: packed(t) + 1, decomposition_table=inductor_decompositions)(x)
    ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("packed_linear" in op for op in ops) and not any("sum" in op for op in ops)
    step = torch.compile(lambda t: packed(t) + 1, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        assert torch.equal(step(x), packed(x) + 1)
