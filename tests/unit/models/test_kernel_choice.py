"""The CPU GEMM rule: one kernel per dtype, ISA and ``model.cpu_kernels``, the same at every row
count (never a timing), each kernel computing the Linear, and a row's bits independent of the
rows beside it. ``HYLOOP_CPU_ISA`` masks the CPU's flags, so CPUs without AVX-512 are covered."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import BF16_PACKED
from torch import nn

from hyloop.models.cpu import CpuKernels, cpu_ops, kernel_choice
from hyloop.models.cpu.kernel_choice import bf16_dot, cpu_isa, dense_kernel
from hyloop.models.cpu.packed_linear import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu")), reason="oneDNN is not available in this build"
)
native = pytest.mark.skipif(
    not cpu_ops.ensure_loaded(), reason="no C++ compiler: hyloop's CPU kernels cannot be built"
)


@pytest.mark.parametrize("isa", ["AVX512", "AVX2", "DEFAULT"])
def test_the_rule_follows_the_isa_and_the_mode(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYLOOP_CPU_ISA", isa)
    monkeypatch.setenv("HYLOOP_CPU_FLAGS", "avx512f avx512_bf16")
    assert cpu_isa() == isa
    for dtype in (torch.float32, torch.bfloat16):
        oneDNN = "packed" if packing_available(torch.device("cpu"), dtype) else "linear"
        want = "tiled" if isa == "AVX512" else oneDNN
        assert dense_kernel(dtype, native=True) == want
        # No kernels loaded: the panels' torch definition where the rule names panels.
        assert dense_kernel(dtype, native=False) == ("reference" if isa == "AVX512" else oneDNN)
        assert dense_kernel(dtype, native=True, mode="packed") == oneDNN


@pytest.mark.parametrize(
    "flags",
    [
        "avx512f avx512_bf16",  # Zen 4 / Zen 5, Cooper Lake
        "avx512f avx512_bf16 amx_bf16 amx_int8 amx_tile",  # Sapphire Rapids and later
        "avx512f",  # Skylake-SP .. Ice Lake: bfloat16 as float32 multiply-adds
    ],
)
def test_bf16_panels_run_on_every_avx512_cpu(flags: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYLOOP_CPU_ISA", "AVX512")
    monkeypatch.setenv("HYLOOP_CPU_FLAGS", flags)
    monkeypatch.delenv("HYLOOP_BF16_DOT", raising=False)
    assert dense_kernel(torch.bfloat16, native=True) == "tiled"
    assert dense_kernel(torch.float32, native=True) == "tiled"
    # Which way the bf16 chain runs: the flags first, then the measured times (the same bits).
    kernel_choice._measured.cache_clear()
    dot_slower = bf16_dot(lambda: (2.0, 1.0))
    kernel_choice._measured.cache_clear()
    dot_faster = bf16_dot(lambda: (1.0, 0.95))
    kernel_choice._measured.cache_clear()
    if "avx512_bf16" in flags:
        assert (dot_slower, dot_faster) == ("fma", "vdpbf16ps")
        assert bf16_dot(None) == "vdpbf16ps"
    else:
        assert dot_slower == dot_faster == bf16_dot(None) == "fma"


def test_bf16_dot_is_overridden_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYLOOP_CPU_FLAGS", "avx512f avx512_bf16")
    monkeypatch.setenv("HYLOOP_BF16_DOT", "fma")
    assert bf16_dot(lambda: (1.0, 5.0)) == "fma"
    monkeypatch.setenv("HYLOOP_BF16_DOT", "amx")
    with pytest.raises(ValueError, match="HYLOOP_BF16_DOT='amx'"):
        bf16_dot(None)


@native
def test_a_bf16_model_names_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYLOOP_CPU_ISA", "AVX512")
    monkeypatch.setenv("HYLOOP_BF16_DOT", "fma")
    try:
        cpu = CpuKernels(_model(torch.bfloat16), pack=True, native=True)
        assert cpu.bf16_dot == "float32 multiply-adds"
        assert "bfloat16 x2: hyloop panels (float32 multiply-adds)" in cpu.numerics()
    finally:
        monkeypatch.delenv("HYLOOP_BF16_DOT")
        cpu_ops.set_bf16_dot(bf16_dot(cpu_ops.bf16_dot_times) == "fma")


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 384), nn.Linear(384, 256)).to(dtype)


@native
@pytest.mark.parametrize("isa", ["AVX512", "AVX2"])
def test_an_engines_kernels_follow_the_masked_flags(
    isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same model, the CPU seen with or without AVX-512: panels and a stack only with it."""
    monkeypatch.setenv("HYLOOP_CPU_ISA", isa)
    model = _model()
    cpu = CpuKernels(model, pack=True, kernels="auto", native=True, stack="auto")
    kernels = {m.kernel for m in cpu.layers}
    assert kernels == ({"tiled"} if isa == "AVX512" else {"packed"})
    assert all((m.panels is not None) == (isa == "AVX512") for m in cpu.layers)
    assert cpu.summary()["isa"] == isa and "choices" in cpu.summary()


@pytest.mark.parametrize("dtype", [torch.float32, BF16_PACKED])
@pytest.mark.parametrize("kernel", ["linear", "packed", "tiled", "reference"])
def test_every_kernel_computes_the_linear(kernel: str, dtype: torch.dtype) -> None:
    if kernel == "tiled" and not cpu_ops.ensure_loaded():
        pytest.skip("no C++ compiler: hyloop's panels cannot be built")
    torch._dynamo.reset()  # a freed layer's id may be reused: no graph of another one applies
    torch.manual_seed(0)
    linear = nn.Linear(256, 384).to(dtype)
    layer = PackedLinear(linear, kernel)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for shape in [(1, 256), (3, 256), (2, 5, 256)]:
        x = torch.randn(shape, dtype=dtype)
        ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        with torch.inference_mode():
            eager = layer(x)
            torch.testing.assert_close(eager.float(), ref, atol=tol, rtol=tol)
            step = torch.compile(lambda t: layer(t) * 1, fullgraph=True, dynamic=False)
            assert torch.equal(step(x), eager)  # the compiled form calls the same kernel


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    """The panels at every row count a step or a prefill chunk runs: row 0 alone is row 0 of
    every batch (one chain per output whatever the tile shape), and their torch definition
    (``reference``, where the kernels are not loaded) gives every row the same bits."""
    torch.manual_seed(1)
    linear = nn.Linear(576, 1536).to(dtype)
    layer = PackedLinear(linear, "tiled")
    x = torch.randn(600, 576).to(dtype)
    with torch.inference_mode():
        alone = layer(x[:1])
        for rows in (2, 3, 8, 9, 16, 17, 32, 33, 64, 600):
            assert torch.equal(layer(x[:rows])[:1], alone), rows
        reference = PackedLinear(linear, "reference")
        for rows in (1, 9, 33):
            assert torch.equal(reference(x[:rows]), layer(x[:rows])), rows


@native
def test_packing_puts_small_linears_on_the_panels_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder stack reads every projection's panels, so none may stay on another kernel."""
    monkeypatch.setenv("HYLOOP_CPU_ISA", "AVX512")
    small = nn.Sequential(nn.Linear(64, 64))
    assert pack_linears(small, lambda dtype: dense_kernel(dtype, native=True)) == 1
    assert isinstance(small[0], PackedLinear) and small[0].kernel == "tiled"
    monkeypatch.setenv("HYLOOP_CPU_ISA", "AVX2")
    small = nn.Sequential(nn.Linear(64, 64))
    assert pack_linears(small, lambda dtype: dense_kernel(dtype, native=True)) == 0
