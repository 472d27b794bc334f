"""One recorder for the loop's clocks: step wall and execution time, capture time, device time.

The loops mark only where a step began and where they waited; the recorder turns that into the
engine's counters. A bucket's first use captures (compiles) it inside a step: that time is kept
apart (``capture_time``), so step times and tok/s describe the replayed loop.

Writers: every field is written by the thread that calls ``Engine.step`` (the scheduler
thread), except ``hidden_host_s``, which only the overlap loop's resolve thread writes.

Device time (``DeviceClock``): of steps, and of the stream time between them, from CUDA events.

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

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hyloop.framework.requests import Batch

if TYPE_CHECKING:
    from hyloop.graphs.capture.bucket_runner import BucketRunner


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
    def __init__(self, clock: DeviceClock, runner: BucketRunner) -> None:
        self.clock = clock
        self.stats = StepStats()
        self._runner = runner  # its ``capture_seconds``: capturing (compiling) so far
        self._capture_seen = 0.0
        self.on_decode: Callable[[Batch, float], None] | None = None  # a decode step's wall

    now = staticmethod(time.perf_counter)

    def launched(self, batch: Batch) -> StepTiming:
        """A launch begins: its host clock and, on CUDA, the event before the step."""
        return StepTiming(
            time.perf_counter(), self.clock.begin(batch.is_decode), self._runner.capture_seconds
        )

    def queued(self, timing: StepTiming) -> None:
        """The step is queued on the device: its end event (before any copy to the host)."""
        self.clock.end(timing.marks, captured=self._runner.capture_seconds > timing.captured_before)

    def returned(self, timing: StepTiming) -> None:
        """The launch returned (on CPU: the step ran and its ids are on the host)."""
        timing.exec_s = time.perf_counter() - timing.t0

    def account(self, batch: Batch, timing: StepTiming, since: float) -> None:
        """A step whose scheduling began at ``since`` and whose launch took ``timing``."""
        s = self.stats
        captured = self._runner.capture_seconds
        cap, self._capture_seen = captured - self._capture_seen, captured
        s.capture_time += cap
        wall, exec_time = time.perf_counter() - since - cap, timing.exec_s - cap
        exposed = max(0.0, wall - exec_time)
        s.host_exposed_time += exposed
        s.step_exec_time += exec_time
        if batch.is_decode:
            s.decode_steps += 1
            s.decode_tokens += sum(c.taken for c in batch.chunks)  # a verify step: several
            s.decode_time += wall
            s.decode_host_exposed_time += exposed
            if self.on_decode is not None:
                self.on_decode(batch, wall)
        else:
            s.prefill_steps += 1
            s.prefill_tokens_computed += sum(c.length for c in batch.chunks)
            s.prefill_time += wall

    def note_captures(self) -> None:
        """Captures made outside any step (a job's planned captures) count as capture time."""
        captured = self._runner.capture_seconds
        self.stats.capture_time += captured - self._capture_seen
        self._capture_seen = captured

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
