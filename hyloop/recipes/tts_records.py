"""The records ``hyloop tts`` writes, one per non-blank input line, in input order: the line's
fields plus ``frames`` (the generated rows' ``.npy``, beside the output), ``num_frames``,
``finish_reason``, ``num_cached_rows`` and, with a codec, ``audio`` (a ``.wav``),
``sample_rate``, ``time_to_first_audio_s`` and ``rtf``; a line that failed gets ``error``
(``<input>:<line>: <field>: <reason>``), printed on stderr too."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hyloop.recipes.job_output import JobOutput
from hyloop.recipes.records import Line
from hyloop.tts import write_wav


class FrameWriter:
    """Writes line ``n``'s record once lines ``0..n-1`` are out; its ``.npy`` / ``.wav`` files
    are written first, so a record on disk always has its files. ``start``: lines already on
    disk (a resumed job)."""

    def __init__(self, out: JobOutput, path: Path, lines: list[Line], start: int = 0) -> None:
        self.out, self.path, self.lines = out, path, lines
        self.written = start
        self.failed = 0
        self.pending: dict[int, dict[str, Any]] = {}

    def put(self, n: int, result: Any, error: str | None) -> None:
        rec = dict(self.lines[n].row or {})
        if error is not None:
            self.failed += 1
            rec["error"] = error
            print(f"hyloop: error: {error}", file=sys.stderr)
        else:
            rec.update(self._files(n, result))
        self.pending[n] = rec
        text = []
        while self.written in self.pending:
            text.append(json.dumps(self.pending.pop(self.written)) + "\n")
            self.written += 1
        if text:
            self.out.write("".join(text))

    def _files(self, n: int, out: Any) -> dict[str, Any]:
        frames = self.path.with_name(f"{self.path.stem}.{n}.npy")
        np.save(frames, out.rows)
        fields: dict[str, Any] = {
            "frames": frames.name,
            "num_frames": len(out.rows),
            "finish_reason": out.finish_reason,
            "num_cached_rows": out.num_cached_rows,
        }
        if out.audio is not None and out.sample_rate is not None:
            wav = self.path.with_name(f"{self.path.stem}.{n}.wav")
            write_wav(wav, out.audio, out.sample_rate)
            m = out.metrics
            fields.update(
                audio=wav.name,
                sample_rate=out.sample_rate,
                time_to_first_audio_s=m.time_to_first_audio_s if m else None,
                rtf=m.rtf if m else None,
            )
        return fields
