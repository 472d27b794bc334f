"""The records ``hyloop tts`` writes, one per non-blank input line, in input order: the line's
fields plus ``frames`` (the generated rows' ``.npy``, beside the output), ``num_frames``,
``finish_reason``, ``num_cached_rows`` and, with a codec, ``audio`` (a ``.wav``),
``sample_rate``, ``time_to_first_audio_s`` and ``rtf``; a line that failed gets ``error``
(``<input>:<line>: <field>: <reason>``), printed on stderr too."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from hyloop.recipes.job_output import InOrder, JobOutput
from hyloop.recipes.records import Line
from hyloop.tts import write_wav


class FrameWriter(InOrder):
    """Writes line ``n``'s record in input order (``InOrder``); its ``.npy`` / ``.wav`` files
    are written first, so a record on disk always has its files."""

    def __init__(self, out: JobOutput, path: Path, lines: list[Line], start: int = 0) -> None:
        super().__init__(out, start)
        self.path, self.lines = path, lines
        self.failed = 0

    def put(self, n: int, result: Any, error: str | None = None) -> None:
        rec = dict(self.lines[n].row or {})
        if error is not None:
            self.failed += 1
            rec["error"] = error
            print(f"hyloop: error: {error}", file=sys.stderr)
        else:
            rec.update(self._files(n, result))
        super().put(n, rec)

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
