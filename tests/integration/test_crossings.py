"""The map cannot drift: the file crossings of one default text request and of one TTS request,
recorded as they run, are the lists in ``docs/architecture.md``.

A crossing is a call from one ``hyloop/`` file into a function of another (frames of torch or the
standard library in between are looked through), each (caller file, callee file) edge once;
constructors and module bodies are not counted. Recorded under ``graphs.backend=eager`` (a
compiled step hides its layers from a profiler), on a second request, so that first-use work
(imports, kernel builds) is not in it. The CPU is seen as AVX2 (``HYLOOP_CPU_ISA``), so every
x86 machine records the same route: with AVX-512 a dense model's Linears run hyloop's panels and
its decode steps the decoder stack, which adds the hops of ``models/cpu/``.
A new crossing fails this test until the doc lists it;
``HYLOOP_WRITE_CROSSINGS=1 pytest tests/integration/test_crossings.py`` rewrites the lists.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest

import hyloop

PACKAGE = Path(hyloop.__file__).resolve().parent
DOC = PACKAGE.parent / "docs" / "architecture.md"
NOT_COUNTED = {"__init__", "__new__", "__post_init__", "__init_subclass__", "<module>"}


def record(run: Callable[[], Any]) -> dict[tuple[str, str], str]:
    """(caller file, callee file) -> the first callee function seen, over ``run()``."""
    root = str(PACKAGE) + os.sep
    edges: dict[tuple[str, str], str] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(root) or code.co_name in NOT_COUNTED:
            return
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(root):
            caller = caller.f_back
        if caller is None or caller.f_code.co_filename == code.co_filename:
            return
        key = (caller.f_code.co_filename[len(root) :], code.co_filename[len(root) :])
        edges.setdefault(key, code.co_qualname)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return edges


def render(edges: dict[tuple[str, str], str]) -> str:
    lines = [f"{a} -> {b} ({fn})" for (a, b), fn in sorted(edges.items())]
    return "\n".join(lines)


def doc_block(name: str) -> tuple[str, re.Match[str] | None]:
    text = DOC.read_text()
    pattern = rf"(<!-- crossings:{name} -->\n```text\n)(.*?)(\n```\n<!-- /crossings:{name} -->)"
    return text, re.search(pattern, text, re.S)


def count_pattern(name: str) -> str:
    return rf"<!-- count:{name} -->(\d+)<!-- /count:{name} -->"


def check(name: str, edges: dict[tuple[str, str], str]) -> None:
    recorded = render(edges)
    text, m = doc_block(name)
    if os.environ.get("HYLOOP_WRITE_CROSSINGS") == "1":
        assert m is not None, f"docs/architecture.md has no crossings:{name} block"
        text = text[: m.start(2)] + recorded + text[m.end(2) :]
        count = f"<!-- count:{name} -->{len(edges)}<!-- /count:{name} -->"
        DOC.write_text(re.sub(count_pattern(name), count, text))
        text, m = doc_block(name)
    assert m is not None, f"docs/architecture.md has no crossings:{name} block"
    listed = m.group(2)
    assert listed == recorded, (
        f"the {name} request's file crossings differ from docs/architecture.md's list "
        "(HYLOOP_WRITE_CROSSINGS=1 rewrites it):\n"
        + "\n".join(f"- {x}" for x in sorted(set(listed.splitlines()) - set(recorded.splitlines())))
        + "\n"
        + "\n".join(f"+ {x}" for x in sorted(set(recorded.splitlines()) - set(listed.splitlines())))
    )
    said = re.search(count_pattern(name), text)
    assert said is not None and int(said.group(1)) == len(edges), (
        f"docs/architecture.md should count {len(edges)} {name} crossings"
    )


@pytest.fixture(autouse=True)
def _the_same_route_on_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYLOOP_CPU_ISA", "AVX2")
    monkeypatch.setenv("HYLOOP_CPU_FLAGS", "avx2 fma f16c")


def test_a_default_text_requests_crossings_are_the_docs(gguf_path: Path) -> None:
    from hyloop import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(model=str(gguf_path), overrides=["graphs.backend=eager"]) as llm:
        llm.generate(["The capital of France is"], params, use_tqdm=False)  # first use
        edges = record(lambda: llm.generate(["The capital of Italy is"], params, use_tqdm=False))
    check("text", edges)


def test_a_tts_requests_crossings_are_the_docs(moss_local_ckpts: dict[str, Path]) -> None:
    from hyloop.tts import TTSEngine, TTSParams

    rng = np.random.default_rng(0)
    rows = rng.integers(0, 16, (8, 4))
    rows[:4, 1:] = 16
    overrides = ["graphs.backend=eager", "kv_pool.page_size=4", "kv_pool.num_pages=256"]
    with TTSEngine(moss_local_ckpts["nvq3_v16_l1"], overrides=overrides) as tts:

        def one(seed: int) -> None:  # stream(): the engine steps on this thread
            tts.add_request(rows, TTSParams(max_frames=6, seed=seed))
            for _ in tts.stream():
                pass

        one(1)  # first use
        edges = record(lambda: one(2))
    check("tts", edges)
