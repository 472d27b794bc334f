"""``FlexibleArgumentParser``: vLLM's argument parser, which takes ``--max_model_len`` for
``--max-model-len``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose long options may be spelled with underscores."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> argparse.Namespace:
        return super().parse_args(_dashes(args), namespace)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        return super().parse_known_args(_dashes(args), namespace)


def _dashes(args: Sequence[str] | None) -> list[str]:
    out = []
    for arg in sys.argv[1:] if args is None else args:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out
