"""Measured GEMM kernel choice: the faster candidate wins, the choice is kept per machine and
read back, and every kernel a Linear can be given computes the same product."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import BF16_PACKED
from torch import nn

from hyloop.models.cpu.kernel_choice import (
    KernelTable,
    calibrate,
    fastest,
    machine_key,
    shape_key,
    time_candidates,
)
from hyloop.models.cpu.packed_linear import PackedLinear, packing_available

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu")), reason="oneDNN is not available in this build"
)


def test_the_faster_of_two_candidates_is_chosen() -> None:
    def slow() -> None:
        time.sleep(0.002)

    def quick() -> None:
        pass

    for order in ({"slow": slow, "quick": quick}, {"quick": quick, "slow": slow}):
        timings = time_candidates(order, budget_s=0.02)
        assert timings["slow"] >= 2000 > timings["quick"]
        assert fastest(timings) == "quick"


def layers(dtype: torch.dtype = torch.float32) -> list[PackedLinear]:
    torch.manual_seed(0)
    return [PackedLinear(nn.Linear(256, 384).to(dtype)) for _ in range(2)]


def test_choices_are_kept_per_machine_and_read_back(tmp_path: Path) -> None:
    first = layers()
    table = calibrate(first, [1, 4], with_gemv=False, table=KernelTable.load(tmp_path))
    assert table.measured == 2  # one shape (two layers share it) x two row counts
    path = tmp_path / "kernels" / f"{machine_key()}.json"
    saved = json.loads(path.read_text())
    assert saved["machine"] == machine_key()
    us = saved["entries"][shape_key(first[0].weight)]["4"]
    assert set(us) == {"linear", "packed"} and all(v > 0 for v in us.values())
    assert dict(first[0].kernels)[4] == min(us, key=us.get)
    assert first[0].kernels == first[1].kernels

    again = layers()
    table = calibrate(again, [1, 4], with_gemv=False, table=KernelTable.load(tmp_path))
    assert table.measured == 0  # nothing to time on the second run
    assert again[0].kernels == first[0].kernels


def test_a_corrupt_table_is_measured_again(tmp_path: Path) -> None:
    path = tmp_path / "kernels" / f"{machine_key()}.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"machine": "' + machine_key() + '", "entries": {"float32 384x256": 7}}')
    table = calibrate(layers(), [2], with_gemv=False, table=KernelTable.load(tmp_path))
    assert table.measured == 1


def test_gemv_is_a_candidate_for_one_row_of_a_compiled_step(tmp_path: Path) -> None:
    table = calibrate(layers(), [1, 2], with_gemv=True, table=KernelTable.load(tmp_path))
    by_rows = table.entries["float32 384x256"]
    assert set(by_rows[1]) == {"linear", "packed", "gemv"}
    assert set(by_rows[2]) == {"linear", "packed"}
    # An eager engine on the same machine reads the same timings without the GEMV.
    eager = table.choices("float32 384x256", ("linear", "packed"))
    assert eager[1] in ("linear", "packed")


def test_a_row_count_takes_the_next_measured_choice_above() -> None:
    layer = layers()[0]
    layer.set_kernels({1: "gemv", 4: "linear", 16: "packed"})
    assert [layer.kernel(r, compiled=True) for r in (1, 2, 4, 5, 16, 64)] == [
        "gemv", "linear", "linear", "packed", "packed", "packed",
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, BF16_PACKED])
@pytest.mark.parametrize("kernel", ["linear", "packed", "gemv"])
def test_every_kernel_computes_the_linear(kernel: str, dtype: torch.dtype) -> None:
    layer = layers(dtype)[0]
    layer.set_kernels({64: kernel})
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for shape in [(1, 256), (3, 256), (2, 5, 256)]:
        x = torch.randn(shape, dtype=dtype)
        ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        with torch.inference_mode():
            torch.testing.assert_close(layer(x).float(), ref, atol=tol, rtol=tol)
            if shape[0] == 1:
                step = torch.compile(lambda t: layer(t) * 1, fullgraph=True, dynamic=False)
                torch.testing.assert_close(step(x).float(), ref, atol=tol, rtol=tol)


def test_the_table_lives_where_its_variable_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYLOOP_KERNEL_TABLE_DIR", str(tmp_path / "elsewhere"))
    table = KernelTable.load()
    assert table.path == tmp_path / "elsewhere" / f"{machine_key()}.json"
    table.entries["float32 8x8"] = {1: {"tiled": 1.0}}
    table.save()
    assert KernelTable.load().entries == table.entries
    monkeypatch.delenv("HYLOOP_KERNEL_TABLE_DIR")
    monkeypatch.setenv("HYLOOP_CACHE_DIR", str(tmp_path / "cache"))
    assert KernelTable.load().path == tmp_path / "cache" / "kernels" / f"{machine_key()}.json"
