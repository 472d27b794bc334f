"""The loops see only the pipeline and the recorder; the engine sees only the loops' surface.

Two checks: a static one over the sources (who imports the ``Engine``; no loop or pipeline
module names it), and a live one that runs both loops with spies on the ``Engine`` and on the
loop classes and fails on any attribute read across the boundary.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import pytest

import hyloop
from hyloop import LLM, SamplingParams
from hyloop.framework.engine import Engine
from hyloop.framework.loops import OverlapLoop, SyncLoop

PACKAGE = Path(hyloop.__file__).parent
# Modules that run steps: none of them may know the engine.
LOOP_MODULES = {
    "hyloop.framework.pipeline",
    "hyloop.framework.loops",
    "hyloop.framework.scheduler",
    "hyloop.framework.stats",
    "hyloop.framework.step_kinds",
}
# The public front ends (and assembly) are the only importers of the engine; the package root
# exports it as vLLM's ``LLMEngine``; beam search is ``LLM.beam_search``'s driver over it.
ENGINE_IMPORTERS = {
    "hyloop.api.engine",
    "hyloop.api.llm",
    "hyloop.framework.assembly",
    "hyloop.api.beam_search",
    "hyloop.__init__",
}
LOOP_SURFACE = {"step", "busy", "close"}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts)


def engine_references(path: Path) -> list[str]:
    """Where a module imports the engine module or names ``Engine``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "hyloop.framework.engine":
            found.append(f"line {node.lineno}: from hyloop.framework.engine import ...")
        elif isinstance(node, ast.Import) and any(
            a.name == "hyloop.framework.engine" for a in node.names
        ):
            found.append(f"line {node.lineno}: import hyloop.framework.engine")
        elif isinstance(node, ast.Name) and node.id == "Engine":
            found.append(f"line {node.lineno}: Engine")
    return found


def test_only_front_ends_import_the_engine() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name in ENGINE_IMPORTERS or name == "hyloop.framework.engine":
            continue
        refs = engine_references(path)
        if refs:
            offenders[name] = refs
    assert not offenders, f"modules that reach for the Engine: {offenders}"


# Rooms below the API: none of them imports ``hyloop.api`` (vLLM's surface imports the core).
CORE_ROOMS = ("framework", "features", "graphs", "cache", "pools", "models")


def test_the_core_never_imports_the_api_room() -> None:
    offenders = []
    for room in CORE_ROOMS:
        for path in sorted((PACKAGE / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                if any(n == "hyloop.api" or n.startswith("hyloop.api.") for n in names):
                    offenders.append(f"{module_name(path)}:{node.lineno}")
    assert not offenders, f"core modules that import hyloop.api: {offenders}"


def test_the_static_check_sees_an_engine_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from hyloop.framework.engine import Engine\n\ndef f(e: Engine) -> None: ...\n")
    assert len(engine_references(bad)) == 2


def test_loop_modules_exist() -> None:
    for name in LOOP_MODULES:
        assert (PACKAGE.parent / (name.replace(".", "/") + ".py")).is_file(), name


class Spy:
    """Records attribute reads on instances of ``cls`` made from code in ``modules``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cls: type, modules: set[str]) -> None:
        self.reads: list[tuple[str, str]] = []
        real = cls.__getattribute__
        spy = self

        def getattribute(obj: Any, name: str) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller in modules:
                spy.reads.append((caller, name))
            return real(obj, name)

        monkeypatch.setattr(cls, "__getattribute__", getattribute)


@pytest.mark.parametrize("lookahead", [False, True])
def test_no_attribute_read_crosses_the_loop_boundary(
    tiny_ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch, lookahead: bool
) -> None:
    overrides = [
        "graphs.backend=eager",
        f"lookahead.enable={str(lookahead).lower()}",
        "lookahead.min_batch=1",
    ]
    with LLM(model=tiny_ckpts["llama"], overrides=overrides) as llm:
        engine_spy = Spy(monkeypatch, Engine, LOOP_MODULES)
        loop_spies = [
            Spy(monkeypatch, cls, {"hyloop.framework.engine"}) for cls in (SyncLoop, OverlapLoop)
        ]
        prompts = [[5 + i, 7, 9, 11 + i] for i in range(3)]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.add_request("x", [5, 6, 7], params)
        llm.engine.step()
        llm.engine.abort_request("x")
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        llm.engine.check_invariants()
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert engine_spy.reads == [], "loop code read Engine attributes"
    engine_reads = {name for spy in loop_spies for _, name in spy.reads}
    assert "step" in engine_reads  # the spy is live
    assert engine_reads <= LOOP_SURFACE, f"the engine read loop internals: {engine_reads}"


def test_the_spy_catches_a_loop_reading_the_engine(
    tiny_ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    with LLM(model=tiny_ckpts["llama"], overrides=["graphs.backend=eager"]) as llm:
        spy = Spy(monkeypatch, Engine, {__name__})
        _ = llm.engine.cfg  # read from this module, which the spy watches here
    assert spy.reads == [(__name__, "cfg")]
