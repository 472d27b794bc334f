"""One recorder for the loop's clocks: step wall and execution time, capture time, device time.

The loops mark only where a step began and where they waited; the recorder turns that into the
engine's counters. A bucket's first use captures (compiles) it inside a step: that time is kept
apart (``capture_time``), so step times and tok/s describe the replayed loop.

Writers: every field is written by the thread that calls ``Engine.step`` (the scheduler
thread), except ``hidden_host_s``, which only the overlap loop's resolve thread writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hyloop.framework.batch import Batch
from hyloop.framework.device_clock import DeviceClock, StepMarks


@dataclass
class StepTiming:
    """What the recorder measured of one launch (``launched`` -> ``queued`` -> ``returned``)."""

    t0: float
    marks: StepMarks | None  # device events around the step (CUDA)
    captured_before: float  # capture seconds when the launch began
    exec_s: float = 0.0  # host time inside the launch (on CUDA the launch only)


@dataclass
class StepStats:
    prefill_tokens_computed: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    host_exposed_time: float = 0.0  # step wall time not spent executing the step
    decode_host_exposed_time: float = 0.0  # the same, decode steps only
    capture_time: float = 0.0  # first-use captures/compiles, kept out of the step times
    step_exec_time: float = 0.0
    hidden_host_s: float = 0.0  # overlap loop: host work done while a step ran
    exposed_wait_s: float = 0.0  # overlap loop: waits for that work


class StepRecorder:
    def __init__(self, clock: DeviceClock, capture_seconds: Callable[[], float]) -> None:
        self.clock = clock
        self.stats = StepStats()
        self._cap = capture_seconds
        self._capture_seen = 0.0

    now = staticmethod(time.perf_counter)

    def launched(self, batch: Batch) -> StepTiming:
        """A launch begins: its host clock and, on CUDA, the event before the step."""
        return StepTiming(time.perf_counter(), self.clock.begin(batch.is_decode), self._cap())

    def queued(self, timing: StepTiming) -> None:
        """The step is queued on the device: its end event (before any copy to the host)."""
        self.clock.end(timing.marks, captured=self._cap() > timing.captured_before)

    def returned(self, timing: StepTiming) -> None:
        """The launch returned (on CPU: the step ran and its ids are on the host)."""
        timing.exec_s = time.perf_counter() - timing.t0

    def account(self, batch: Batch, timing: StepTiming, since: float) -> None:
        """A step whose scheduling began at ``since`` and whose launch took ``timing``."""
        s = self.stats
        captured = self._cap()
        cap, self._capture_seen = captured - self._capture_seen, captured
        s.capture_time += cap
        wall, exec_time = time.perf_counter() - since - cap, timing.exec_s - cap
        exposed = max(0.0, wall - exec_time)
        s.host_exposed_time += exposed
        s.step_exec_time += exec_time
        if batch.is_decode:
            s.decode_steps += 1
            s.decode_tokens += batch.size
            s.decode_time += wall
            s.decode_host_exposed_time += exposed
        else:
            s.prefill_steps += 1
            s.prefill_tokens_computed += batch.num_tokens
            s.prefill_time += wall

    def exposed(self, seconds: float, decode: bool, waited: bool = False) -> None:
        """Host time the loop spent with no step running (a drain, or a wait for the resolve
        thread: ``waited``), counted into the step time of its kind."""
        s = self.stats
        s.host_exposed_time += seconds
        if waited:
            s.exposed_wait_s += seconds
        if decode:
            s.decode_time += seconds
            s.decode_host_exposed_time += seconds

    def hidden(self, seconds: float) -> None:
        """Host work the overlap thread did while a step ran (that thread only)."""
        self.stats.hidden_host_s += seconds

    def completed(self, timing: StepTiming) -> None:
        """The step is known complete: book its device time (in launch order)."""
        self.clock.book(timing.marks)

    def pause(self) -> None:
        """The engine ran dry: waiting for new requests is no host time of the loop."""
        self.clock.pause()

    def as_dict(self, overlap: bool) -> dict[str, Any]:
        d = dict(vars(self.stats))
        hidden, wait = d.pop("hidden_host_s"), d.pop("exposed_wait_s")
        if overlap:
            d["lookahead_hidden_host_s"] = hidden
            d["lookahead_wait_s"] = wait
        d.update(self.clock.stats())
        return d
