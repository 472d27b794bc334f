"""The output file of a batch job: one JSON line per finished input line, in input order, each
written whole and flushed as soon as the lines before it are out; resumable after a kill.

A job's output is checked before the model loads (``JobOutput.check``): it must not resolve to
the input, its folder must exist and be writable, and an existing non-empty output is only ever
continued, with ``--resume``, never appended to or replaced otherwise. The file is created (or
reopened) once the model has loaded (``open``), so a command that fails early leaves no output
and an existing one untouched.

Resuming reads the lines already written. A last line cut short by a kill (no newline) is
dropped and its row runs again; every complete line must belong to the same input line
(``same_row``); and the job's fingerprint (the input's bytes, the config) must equal the one the
first run recorded under ``$HYLOOP_CACHE_DIR/jobs/`` (nothing is kept beside the output). A job
that wrote its last line drops its record: resuming a finished output runs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hyloop.models.cpu.kernel_choice import cache_dir

SameRow = Callable[[int, dict[str, Any]], bool]  # (input index, output record) -> same row?


def fingerprint(input_bytes: bytes, config: Any) -> str:
    """A digest of the input file and of everything that configures its outputs (JSON-able)."""
    h = hashlib.sha256(input_bytes)
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    return h.hexdigest()


def check_paths(input_path: str | None, output: str | None, flag: str = "--output") -> None:
    """The output is not the input (or a directory), and its folder exists and is writable."""
    if output is None or output == "-":
        return
    out = Path(output)
    if out.is_dir():
        raise ValueError(f"{flag} {output}: is a directory; expected a file path")
    if input_path not in (None, "-") and _same(Path(input_path), out):
        raise ValueError(
            f"{flag} {output}: resolves to the input file {input_path}; writing it would "
            "destroy the input (give another output path)"
        )
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"{flag} {output}: no folder {folder}")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {output}: folder {folder} is not writable")


def _same(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return a.samefile(b)
    return os.path.realpath(a) == os.path.realpath(b)


class InOrder:
    """Writes result ``i``'s line once lines ``start..i-1`` are written: results come in any
    order, the output keeps the input's, each line written whole as soon as order allows.
    ``start``: lines already on disk (a resumed job); results for them are ignored."""

    def __init__(self, out: Any, start: int = 0) -> None:
        self.out, self.start, self.written = out, start, start
        self.pending: dict[int, Any] = {}

    def put(self, i: int, result: Any) -> None:
        if i < self.start:
            return
        self.pending[i] = result
        text = []
        while self.written in self.pending:
            text.append(self.line(self.written, self.pending.pop(self.written)))
            self.written += 1
        if text:
            self.out.write("".join(text))

    def line(self, i: int, result: Any) -> str:
        """Result ``i`` as its output line."""
        return json.dumps(result) + "\n"


class JobOutput:
    """``check`` before the model loads, ``open`` once it has, then ``write`` each line."""

    def __init__(self, path: str | None, flag: str = "--output") -> None:
        self.path, self.flag = path, flag
        self.done = 0  # input lines whose output line is already on disk
        self.keep_bytes = 0  # the output's whole lines, to keep on resume
        self.complete = False  # resuming an output that already holds every line
        self.rows = 0
        self._fd: int | None = None
        self._print = path == "-"

    @property
    def state_file(self) -> Path:
        key = hashlib.sha256(os.path.realpath(str(self.path)).encode()).hexdigest()[:32]
        return cache_dir() / "jobs" / f"{key}.json"

    def check(self, input_path: str | None, resume: bool, rows: int, same_row: SameRow) -> int:
        """Check the paths and, with ``resume``, the lines already written; returns how many
        input lines are done (0 for a new job)."""
        check_paths(input_path, self.path, self.flag)
        self.rows = rows
        if self.path in (None, "-"):
            if resume:
                raise ValueError(f"--resume needs an output file ({self.flag} {self.path})")
            return 0
        out = Path(self.path)
        size = out.stat().st_size if out.is_file() else 0
        if size and not resume:
            raise ValueError(
                f"{self.flag} {self.path}: exists ({size} bytes); pass --resume to continue that "
                "job, or remove the file to start again"
            )
        if not size:
            return 0
        data = out.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]  # a cut-short last line runs again
        lines = whole.splitlines()
        if len(lines) > rows:
            raise ValueError(
                f"--resume: {self.path} holds {len(lines)} lines but the input has {rows}; it is "
                "not the output of this input"
            )
        for k, raw in enumerate(lines):
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                record = None
            if not isinstance(record, dict) or not same_row(k, record):
                raise ValueError(
                    f"--resume: {self.path}:{k + 1} is not the output of input line {k + 1} of "
                    "this input; give the input it was written from, or remove it"
                )
        self.done, self.keep_bytes = len(lines), len(whole)
        self.complete = self.done == rows and len(whole) == len(data)
        return self.done

    def open(self, fingerprint: str) -> None:
        """Create the output (or, resuming, check the fingerprint and drop a torn last line)."""
        if self.path in (None, "-"):
            return
        state = self.state_file
        if (self.done or self.keep_bytes) and not self.complete:  # a finished job keeps none
            recorded = _read_state(state)
            if recorded is None:
                raise ValueError(
                    f"--resume: no record of the job that wrote {self.path} under {state.parent} "
                    "(written by another command, or the cache was cleared); remove it to start "
                    "again"
                )
            if recorded != fingerprint:
                raise ValueError(
                    f"--resume: {self.path} was written from another input or config (their "
                    "fingerprints differ); rerun the same command, or remove the output"
                )
        state.parent.mkdir(parents=True, exist_ok=True)
        tmp = state.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"output": os.path.realpath(self.path), "job": fingerprint}))
        os.replace(tmp, state)  # whole or not at all
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self._fd, self.keep_bytes)
        os.lseek(self._fd, self.keep_bytes, os.SEEK_SET)

    def write(self, text: str) -> None:
        """One or more whole lines, straight to the file (no buffer a kill could lose)."""
        if self._print:
            print(text, end="", flush=True)
            return
        if self._fd is None:
            return
        data = text.encode("utf-8")
        while data:
            data = data[os.write(self._fd, data) :]

    def close(self) -> None:
        """Close the file; once it holds a line per input line, the resume record goes."""
        if self._fd is None:
            return
        os.fsync(self._fd)
        size = os.fstat(self._fd).st_size
        os.close(self._fd)
        self._fd = None
        assert self.path is not None
        with open(self.path, "rb") as fh:
            lines = sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
        if lines == self.rows and size:
            self.state_file.unlink(missing_ok=True)


def _read_state(path: Path) -> str | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value.get("job") if isinstance(value, dict) else None
