"""Run a program written for vLLM on hyloop, unchanged.

``import hyloop.compat.vllm`` (before the program imports vLLM) makes ``vllm`` resolve to
``hyloop`` and every ``vllm.X`` to ``hyloop.X`` (a meta-path finder at the front of
``sys.meta_path``), and registers distribution metadata, so ``importlib.metadata.version("vllm")``
answers ``VLLM_VERSION``, the vLLM release whose surface hyloop provides. Where a real vLLM is
installed it stays in charge: the alias logs so and installs nothing.

``python -m hyloop.compat.vllm PROGRAM ARGS...`` runs a console script (``lm_eval``), a Python
file or ``-m MODULE`` with the alias installed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata as md
import importlib.util
import logging
import os
import runpy
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

# NOTE: hyloop keeps the names vLLM 0.11 had (StructuredOutputsParams beside the old
# GuidedDecodingParams, ``guided_decoding``) and the module paths later releases moved to
# (``vllm.tokenizers``, ``vllm.renderers.hf``); clients choose code paths by this number.
VLLM_VERSION = "0.11.0"
_ALIAS, _TARGET = "vllm", "hyloop"


def _target(fullname: str) -> str | None:
    if fullname == _ALIAS or fullname.startswith(_ALIAS + "."):
        return _TARGET + fullname[len(_ALIAS) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Hands out the hyloop module itself, so ``vllm.X is hyloop.X``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        # importlib set the alias spec on the shared module; hyloop's own spec stays its spec.
        own = getattr(self, "own_spec", None)
        if own is not None:
            module.__spec__ = own


class _Metadata(md.Distribution):
    """The ``vllm`` distribution record hyloop answers for."""

    hyloop_alias = True

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (
                f"Metadata-Version: 2.1\nName: {_ALIAS}\nVersion: {VLLM_VERSION}\n"
                "Summary: vLLM's offline API, served by hyloop (hyloop.compat.vllm)\n"
            )
        if filename == "top_level.txt":
            return _ALIAS + "\n"
        return None

    def locate_file(self, path: str | os.PathLike[str]) -> Path:
        spec = importlib.util.find_spec(_TARGET)
        origin = Path(spec.origin if spec and spec.origin else ".").parent.parent
        return origin / path


class VLLMAlias(importlib.abc.MetaPathFinder):
    """``vllm`` -> ``hyloop`` for imports, and the ``vllm`` distribution for metadata."""

    hyloop_alias = True

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        real = _target(fullname)
        if real is None:
            return None
        own = importlib.util.find_spec(real)
        if own is None:
            return None
        loader = _AliasLoader(real)
        loader.own_spec = own  # type: ignore[attr-defined]
        spec = importlib.util.spec_from_loader(
            fullname, loader, is_package=own.submodule_search_locations is not None
        )
        if spec is not None and own.submodule_search_locations is not None:
            spec.submodule_search_locations = list(own.submodule_search_locations)
        return spec

    def find_distributions(self, context: Any = None) -> Iterable[md.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("_", "-") == _ALIAS:
            return iter([_Metadata()])
        return iter([])


def real_vllm_installed() -> bool:
    """A vLLM distribution other than this alias is installed."""
    dists = md.distributions(name=_ALIAS)  # type: ignore[no-untyped-call]
    return any(not getattr(d, "hyloop_alias", False) for d in dists)


def installed() -> bool:
    return any(getattr(f, "hyloop_alias", False) for f in sys.meta_path)


def install() -> bool:
    """Installs the alias once; False (and a log line) where a real vLLM is installed."""
    if installed():
        return True
    if real_vllm_installed():
        log.warning("a real vllm is installed; hyloop.compat.vllm leaves `vllm` to it")
        return False
    # NOTE: first, so that the path finder never loads hyloop's files a second time as
    # ``vllm.X`` through the alias package's ``__path__``; it answers for ``vllm*`` only.
    sys.meta_path.insert(0, VLLMAlias())
    return True


def uninstall() -> None:
    """Removes the alias and the ``vllm`` modules it handed out (the hyloop modules stay)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "hyloop_alias", False)]
    for name in [n for n in sys.modules if _target(n) is not None]:
        del sys.modules[name]


def run(argv: Sequence[str]) -> Any:
    """Runs ``argv`` (a console script, a ``.py`` file, or ``-m MODULE``) with the alias; the
    program's return value (a console script's exit status)."""
    usage = "usage: python -m hyloop.compat.vllm PROGRAM [ARGS...] | -m MODULE [ARGS...]"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage, file=sys.stderr)
        return 0 if argv else 2
    install()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(usage, file=sys.stderr)
            return 2
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    program, args = argv[0], list(argv[1:])
    if program.endswith(".py") and Path(program).is_file():
        sys.argv = [program, *args]
        runpy.run_path(program, run_name="__main__")
        return 0
    name = Path(program).name
    scripts = [ep for ep in md.entry_points(group="console_scripts") if ep.name == name]
    if not scripts:
        print(f"hyloop.compat.vllm: no console script or .py file {program!r}", file=sys.stderr)
        return 2
    sys.argv = [program, *args]
    return scripts[0].load()()


if __name__ == "__main__":
    # The importable module installs the alias; this ``__main__`` copy only runs the program.
    from hyloop.compat import vllm as _alias

    sys.exit(_alias.run(sys.argv[1:]))
else:
    install()
