"""Device time of steps, and the device's idle gaps between them, from CUDA events.

On a GPU the host's wall clock cannot tell a step's device time from the host work around it:
under lookahead the launch returns at once, and the scheduler only waits later, for a resolve.
The clock records an event before and after each step on the current stream and reads them once
the step is known complete. A step's device time is ``start -> end``; its idle gap is the
previous step's ``end -> start``, the time the device waited for the host. The gap is the
exposed host time as the GPU sees it, in any mode. Gaps are counted only between steps of one
busy period: an idle engine (no batch to run) ends it.

On CPU a step runs synchronously on the host, so there is nothing to record; the engine's wall
clock split (``step_exec_time`` / ``host_exposed_time``) already says what this clock would.

NOTE: under lookahead the thread may queue the next plan's input copies on the stream before
the step's end event is recorded; those few small copies then count as the step's busy time.

Events are booked in launch order by whichever thread resolves the step (one at a time: see
``lookahead``), so the clock needs no lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepMarks:
    """The events around one launched step."""

    start: Any
    end: Any | None = None
    decode: bool = True


class DeviceClock:
    def __init__(self, device: torch.device, event: Callable[[], Any] | None = None) -> None:
        if event is None and device.type == "cuda":

            def event() -> Any:
                return torch.cuda.Event(enable_timing=True)

        self._event = event
        self._last_end: Any | None = None
        self.steps = 0
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.decode_busy_s = 0.0
        self.decode_idle_s = 0.0

    @property
    def enabled(self) -> bool:
        return self._event is not None

    def begin(self, decode: bool) -> StepMarks | None:
        """Record the start of a step on the current stream (None where the clock is off)."""
        if self._event is None:
            return None
        ev = self._event()
        ev.record()
        return StepMarks(ev, decode=decode)

    def end(self, marks: StepMarks | None) -> None:
        """Record the end of the step begun with ``marks``."""
        if marks is not None:
            assert self._event is not None
            marks.end = self._event()
            marks.end.record()

    def book(self, marks: StepMarks | None) -> None:
        """Add a completed step's device time and the gap before it (launch order)."""
        if marks is None:
            return
        assert marks.end is not None, "book() before end()"
        marks.end.synchronize()
        busy = marks.start.elapsed_time(marks.end) / 1e3
        gap = 0.0
        if self._last_end is not None:
            gap = max(0.0, self._last_end.elapsed_time(marks.start) / 1e3)
        self._last_end = marks.end
        self.steps += 1
        self.busy_s += busy
        self.idle_s += gap
        if marks.decode:
            self.decode_busy_s += busy
            self.decode_idle_s += gap

    def pause(self) -> None:
        """The engine ran out of work: the next step's gap is not host time of this loop."""
        self._last_end = None

    def stats(self) -> dict[str, float | int]:
        if not self.enabled:
            return {}
        return {
            "device_timed_steps": self.steps,
            "device_busy_time": self.busy_s,
            "device_idle_time": self.idle_s,
            "decode_device_busy_time": self.decode_busy_s,
            "decode_device_idle_time": self.decode_idle_s,
        }
