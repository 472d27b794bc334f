"""Device time of steps, and the stream time between them, from CUDA events.

On a GPU the host's wall clock cannot tell a step's device time from the host work around it:
under lookahead the launch returns at once, and the scheduler only waits later, for a resolve.
The clock records an event before and after each step on the step device's current stream and
reads them once the step is known complete. A step's busy time is ``start -> end``; its gap is
the previous step's ``end -> start``: stream time spent outside the steps, which is the device
waiting on the host, plus the little non-step work queued between two steps (the input copies
of the next step, the copy of the sampled ids to the host, the id gather that binds a planned
step). The gap is what a faster host loop can win back, in any mode. Gaps are counted only
within one busy period: the engine running out of requests ends it.

A step that captured (compiled) a bucket on first use holds the capture's host time between
its events; its busy time is left out, as the engine's step times leave capture time out.

On CPU a step runs synchronously on the host, so there is nothing to record; the engine's wall
clock split (``step_exec_time`` / ``host_exposed_time``) already says what this clock would.

Events are booked in launch order by the thread that calls ``Engine.step`` (the recorder does
it once a step is known complete), so the clock needs no lock. Booked events go back to a free
list for reuse.
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
    captured: bool = False  # a first-use capture ran inside the step


class DeviceClock:
    def __init__(self, device: torch.device, event: Callable[[], Any] | None = None) -> None:
        self.device = device
        if event is None and device.type == "cuda":

            def event() -> Any:
                return torch.cuda.Event(enable_timing=True)

        self._new_event = event
        self._free: list[Any] = []  # booked events, ready to be recorded again
        self._last_end: Any | None = None
        self.steps = 0
        self.captured_steps = 0
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.decode_busy_s = 0.0
        self.decode_idle_s = 0.0

    @property
    def enabled(self) -> bool:
        return self._new_event is not None

    def _record(self) -> Any:
        assert self._new_event is not None
        ev = self._free.pop() if self._free else self._new_event()
        if self.device.type == "cuda":
            # The step's device, not the current one: with ``cuda:1`` they differ.
            ev.record(torch.cuda.current_stream(self.device))
        else:
            ev.record()
        return ev

    def begin(self, decode: bool) -> StepMarks | None:
        """Record the start of a step (None where the clock is off)."""
        if self._new_event is None:
            return None
        return StepMarks(self._record(), decode=decode)

    def end(self, marks: StepMarks | None, captured: bool = False) -> None:
        """Record the end of the step begun with ``marks``; ``captured``: it captured a bucket."""
        if marks is not None:
            marks.end = self._record()
            marks.captured = captured

    def book(self, marks: StepMarks | None) -> None:
        """Add a completed step's busy time and the gap before it (in launch order)."""
        if marks is None:
            return
        assert marks.end is not None, "book() before end()"
        marks.end.synchronize()
        gap = 0.0
        if self._last_end is not None:
            gap = max(0.0, self._last_end.elapsed_time(marks.start) / 1e3)
            self._free.append(self._last_end)
        self._last_end = marks.end
        self.steps += 1
        self.idle_s += gap
        if marks.decode:
            self.decode_idle_s += gap
        if marks.captured:
            self.captured_steps += 1
        else:
            busy = marks.start.elapsed_time(marks.end) / 1e3
            self.busy_s += busy
            if marks.decode:
                self.decode_busy_s += busy
        self._free.append(marks.start)

    def pause(self) -> None:
        """The engine ran out of requests: the wait for the next ones is no gap of this loop."""
        if self._last_end is not None:
            self._free.append(self._last_end)
            self._last_end = None

    def stats(self) -> dict[str, float | int]:
        if not self.enabled:
            return {}
        return {
            "device_timed_steps": self.steps,
            "device_captured_steps": self.captured_steps,
            "device_busy_time": self.busy_s,
            "device_idle_time": self.idle_s,
            "decode_device_busy_time": self.decode_busy_s,
            "decode_device_idle_time": self.decode_idle_s,
        }
