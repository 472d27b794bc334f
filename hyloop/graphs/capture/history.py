"""Step times and capture costs measured on this machine, kept per model across runs.

``$HYLOOP_CACHE_DIR/steps/<key>.json`` (the key: machine, model file, dtype, device, the
step's configuration) holds, per backend, the median decode-step time of each batch bucket seen
in the latest run that measured it, and the capture (compile) times of each artifact key (the
first from nothing, later ones with inductor's on-disk cache warm). ``graphs.backend=auto``
plans from it (``auto_plan``); ``hyloop warmup`` fills it. Files are written atomically; an
unreadable one is treated as empty.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from hyloop.graphs.capture.auto_plan import Estimates, key_label

__all__ = ["StepHistory", "history_key"]

log = logging.getLogger(__name__)

MIN_SAMPLES = 3  # steps of one bucket before its median replaces the kept figure
KEEP_CAPTURES = 4  # per artifact key: the first (cold) and the latest warm ones


def history_key(*parts: object) -> str:
    return hashlib.blake2b("\n".join(map(str, parts)).encode(), digest_size=10).hexdigest()


class StepHistory:
    """Measured figures of one model on this machine; ``record_*`` in a run, ``save`` after."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.step_ms: dict[str, dict[int, float]] = defaultdict(dict)  # backend -> bucket -> ms
        # backend -> artifact key label -> seconds, oldest first
        self.capture_s: dict[str, dict[str, list[float]]] = defaultdict(dict)
        self._samples: dict[tuple[str, int], list[float]] = defaultdict(list)
        self._dirty = False
        self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            for backend, by_bucket in data.get("step_ms", {}).items():
                self.step_ms[backend] = {int(b): float(ms) for b, ms in by_bucket.items()}
            for backend, by_key in data.get("capture_s", {}).items():
                self.capture_s[backend] = {
                    str(k): [float(t) for t in times] for k, times in by_key.items()
                }
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("hyloop: ignoring unreadable step history %s (%s)", self.path, e)

    # -- record ---------------------------------------------------------------------------------
    def record_step(self, backend: str, bucket: int, seconds: float) -> None:
        self._samples[(backend, bucket)].append(seconds * 1e3)

    def record_capture(self, backend: str, key: tuple[int, int], seconds: float) -> None:
        times = self.capture_s[backend].setdefault(key_label(key), [])
        times.append(round(seconds, 3))
        if len(times) > KEEP_CAPTURES:  # keep the first: the cost from nothing
            del times[1 : len(times) - KEEP_CAPTURES + 1]
        self._dirty = True

    def flush_samples(self) -> None:
        """Fold this run's step samples into the kept medians."""
        for (backend, bucket), ms in self._samples.items():
            if len(ms) >= MIN_SAMPLES:
                self.step_ms[backend][bucket] = round(statistics.median(ms), 3)
                self._dirty = True
        self._samples.clear()

    # -- read -----------------------------------------------------------------------------------
    def estimates(self, backend: str, defaults: Estimates) -> Estimates:
        """A copy of ``defaults`` with this history's figures for the eager and ``backend``
        steps (``defaults`` itself is left as it is)."""
        eager = dict(self.step_ms.get("eager", {}))
        captured = dict(self.step_ms.get(backend, {}))
        captures = {k: list(v) for k, v in self.capture_s.get(backend, {}).items()}
        return dataclasses.replace(
            defaults,
            eager_ms=eager,
            captured_ms=captured,
            captures=captures,
            measured=bool(eager or captured or captures),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "step_ms": {
                k: {str(b): ms for b, ms in sorted(v.items())} for k, v in self.step_ms.items()
            },
            "capture_s": dict(self.capture_s),
        }

    def save(self) -> None:
        self.flush_samples()
        if not self._dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as fh:
                json.dump(self.as_dict(), fh, indent=1)
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError as e:  # a read-only cache directory costs the history, nothing else
            log.warning("hyloop: could not keep step history in %s: %s", self.path, e)
