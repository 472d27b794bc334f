"""What every batch recipe shares around its rows: reading the input line by line (a line that
is not UTF-8 fails alone), the seed of a row that gives none, text a row may not hold, and the
signals that stop a job.

Signals: the first SIGINT or SIGTERM stops the job cleanly. Before any row runs (the model
still loading) it ends the command at once (``Interrupted``); once rows run, nothing more is
admitted, the running rows finish and are written in order, and the command exits 130 / 143 with
one summary line. A second signal exits at once: every line on disk was written whole
(``job_output``), so what is there stays a valid, resumable output.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from hyloop.framework.prompts import check_text


class Interrupted(Exception):  # noqa: N818 (a signal, not an error)
    """A signal ended the command before it had anything to write."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def read_input(path: str, flag: str = "--input") -> tuple[bytes, list[str | ValueError]]:
    """The input's bytes and its lines, each decoded alone: a line that is not UTF-8 is a
    ValueError naming the file and the line (``-``: stdin)."""
    if path == "-":
        import sys

        data = sys.stdin.buffer.read()
    else:
        p = Path(path)
        if p.is_dir():
            raise ValueError(f"{flag} {path}: is a directory; expected a JSONL file")
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(f"{flag} {path}: no such file") from None
        except PermissionError:
            raise ValueError(f"{flag} {path}: permission denied") from None
    lines: list[str | ValueError] = []
    for n, raw in enumerate(data.splitlines(), 1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            byte = raw[e.start]
            lines.append(
                ValueError(f"{path}:{n}: byte 0x{byte:02x} at column {e.start + 1} is not UTF-8")
            )
    return data, lines


def row_seed(config_seed: int, key: str) -> int:
    """The seed of a row that gives none: a function of the config's seed and the row's own
    name (its ``custom_id`` or line), never of when it happens to be admitted, so a resumed or
    reordered job samples each row as an uninterrupted one does."""
    digest = hashlib.blake2b(f"{config_seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def row_key(row: dict[str, Any], number: int) -> str:
    """What names a row for ``row_seed``: its ``id`` when it has one, else its line number."""
    return f"id {json.dumps(row['id'])}" if "id" in row else f"line {number}"


def check_strings(where: str, value: Any, path: str = "") -> None:
    """Every string in a JSON value (keys too) must be UTF-8 encodable; the error names the
    field (``messages[0].content``)."""
    if isinstance(value, str):
        check_text(f"{where}: {path or 'value'}", value)
    elif isinstance(value, dict):
        for k, v in value.items():
            name = f"{path}.{k}" if path else str(k)
            if isinstance(k, str):
                check_text(f"{where}: {path or 'object'} key", k)
            check_strings(where, v, name)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_strings(where, v, f"{path}[{i}]")


class JobSignals:
    """SIGINT / SIGTERM while a job runs (main thread only; elsewhere a no-op): see the module
    docstring. ``start(drain)`` marks the point from which rows are written (``drain``: what
    a first signal calls, e.g. ``LLM.drain``, which only sets a flag); ``signum`` is the first
    signal's number (None: none came)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._drain: Callable[[], None] | None = None
        self._running = False
        self._saved: dict[int, Any] = {}

    def start(self, drain: Callable[[], None]) -> None:
        """Rows run from here on: a first signal calls ``drain`` rather than ending at once."""
        self._drain, self._running = drain, True

    @property
    def exit_code(self) -> int | None:
        return None if self.signum is None else 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def report(self, command: str, written: int, total: int, where: str, unit: str) -> int:
        """A stopped job's one summary line (on stderr); returns its exit code (130 / 143)."""
        assert self.exit_code is not None, "report: no signal came"
        print(
            f"{command}: interrupted by {self.name}: {written} of {total} {unit} in {where}; "
            "rerun with --resume to finish",
            file=sys.stderr,
        )
        return self.exit_code

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second: out now; every line on disk is whole
            os._exit(128 + signum)
        self.signum = signum
        if not self._running or self._drain is None:
            raise Interrupted(signum)
        self._drain()  # sets a flag only: nothing here may take a lock

    def install(self) -> None:
        """Take the signals (again: a library that installed its own handlers since, as Ray's
        core worker does for SIGTERM, gives them back)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                old = signal.signal(sig, self._handle)
                self._saved.setdefault(sig, old)

    def __enter__(self) -> JobSignals:
        self.install()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, old in self._saved.items():
            signal.signal(sig, old)
        self._saved.clear()
