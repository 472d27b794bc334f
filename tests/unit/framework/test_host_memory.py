"""The heap's freed pages go back to the system after an engine is built (``host_memory``)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from hyloop.framework import assembly
from hyloop.framework.config import load_config
from hyloop.utils.host_memory import trim_heap

MB = 1 << 20


def resident_anon_bytes() -> int:
    """This process's resident anonymous memory (``RssAnon`` of ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("/proc/self/status has no RssAnon line")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_trim_returns_the_freed_heap() -> None:
    """Blocks freed in the middle of the heap stay resident until the trim returns them."""
    big = torch.ones(16 * MB // 4)
    del big  # a freed mmapped block raises glibc's mmap threshold: 1 MB blocks come from the heap
    blocks = [torch.ones(MB // 4) for _ in range(200)]
    keep = blocks[-1]  # the heap's top stays in use: only a trim can return what lies below it
    del blocks
    gc.collect()
    held = resident_anon_bytes()
    if not trim_heap():
        pytest.skip("this C library has no malloc_trim")
    returned = held - resident_anon_bytes()
    if returned < 0:
        pytest.fail(f"resident memory grew by {-returned / MB:.0f} MB over a trim")
    assert returned > 100 * MB, f"{returned / MB:.0f} MB of ~199 MB freed came back"
    assert float(keep.sum()) == MB // 4


def test_an_engine_is_trimmed_once_built(
    tiny_ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its weights, kernels and pools: nothing the build freed stays resident."""
    calls: list[int] = []
    monkeypatch.setattr(assembly, "trim_heap", lambda: calls.append(1) or True)
    with pytest.raises(ValueError, match="no checkpoint"):  # fails before anything is built
        assembly.build_engine(load_config(overrides=["model.path="]))
    assert calls == []
    overrides = ["graphs.backend=eager", "model.max_context=32", "kv_pool.num_pages=8"]
    engine = assembly.build_engine(
        load_config(overrides=[f"model.path={tiny_ckpts['llama']}", *overrides])
    )
    try:
        assert calls == [1]
    finally:
        engine.close()
