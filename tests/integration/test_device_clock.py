"""Device time from step events: the arithmetic of ``DeviceClock`` and its wiring in the loop.

On CPU the clock is off (a synchronous step has nothing to record). Its arithmetic is checked
with events that read a fake timeline, and its wiring with events that read the host's clock:
with lookahead on and off, every launched step must be booked exactly once, in launch order,
and the device's busy and idle time must fit inside the loop's wall time. On CUDA the real
events are checked the same way.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hyloop import LLM, SamplingParams
from hyloop.framework.stats import DeviceClock


class FakeTimeline:
    """A settable clock; its events read it on ``record()`` (times in seconds)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.recorded: list[float] = []

    def event(self) -> Any:
        line = self

        class Event:
            t: float | None = None

            def record(self) -> None:
                self.t = line.now
                line.recorded.append(line.now)

            def synchronize(self) -> None:
                assert self.t is not None, "synchronize() on an event never recorded"

            def elapsed_time(self, other: Any) -> float:  # milliseconds, like CUDA's
                return (other.t - self.t) * 1e3

        return Event()


def step(clock: DeviceClock, line: FakeTimeline, gap: float, busy: float, decode: bool) -> Any:
    line.now += gap
    marks = clock.begin(decode)
    line.now += busy
    clock.end(marks)
    return marks


def test_busy_and_idle_add_up_by_kind() -> None:
    line = FakeTimeline()
    clock = DeviceClock(torch.device("cpu"), event=line.event)
    assert clock.enabled
    clock.book(step(clock, line, 0.5, 2.0, decode=False))  # prefill; first: no gap
    clock.book(step(clock, line, 0.25, 1.0, decode=True))
    clock.book(step(clock, line, 0.125, 1.0, decode=True))
    s = clock.stats()
    assert s["device_timed_steps"] == 3
    assert s["device_busy_time"] == pytest.approx(4.0)
    assert s["device_idle_time"] == pytest.approx(0.375)
    assert s["decode_device_busy_time"] == pytest.approx(2.0)
    assert s["decode_device_idle_time"] == pytest.approx(0.375)


def test_pause_ends_a_busy_period() -> None:
    line = FakeTimeline()
    clock = DeviceClock(torch.device("cpu"), event=line.event)
    clock.book(step(clock, line, 0.0, 1.0, decode=True))
    clock.pause()  # the engine ran dry: the wait for new requests is nobody's host time
    clock.book(step(clock, line, 100.0, 1.0, decode=True))
    clock.book(step(clock, line, 0.5, 1.0, decode=True))
    assert clock.stats()["decode_device_idle_time"] == pytest.approx(0.5)


def test_steps_in_flight_are_booked_after_they_end() -> None:
    """Lookahead: step N+1 is launched (both events recorded) before step N is booked."""
    line = FakeTimeline()
    clock = DeviceClock(torch.device("cpu"), event=line.event)
    first = step(clock, line, 0.0, 1.0, decode=True)
    second = step(clock, line, 0.25, 1.0, decode=True)
    clock.book(first)
    clock.book(second)
    assert clock.stats()["decode_device_idle_time"] == pytest.approx(0.25)
    assert clock.stats()["decode_device_busy_time"] == pytest.approx(2.0)


def test_a_capturing_step_keeps_its_gap_but_not_its_busy_time() -> None:
    line = FakeTimeline()
    clock = DeviceClock(torch.device("cpu"), event=line.event)
    clock.book(step(clock, line, 0.0, 1.0, decode=True))
    line.now += 0.5
    marks = clock.begin(True)
    line.now += 40.0  # a first-use compile between the events
    clock.end(marks, captured=True)
    clock.book(marks)
    clock.book(step(clock, line, 0.25, 1.0, decode=True))
    s = clock.stats()
    assert s["device_captured_steps"] == 1 and s["device_timed_steps"] == 3
    assert s["decode_device_busy_time"] == pytest.approx(2.0)
    assert s["decode_device_idle_time"] == pytest.approx(0.75)


def test_booked_events_are_recorded_again() -> None:
    line = FakeTimeline()
    made = []

    def event() -> Any:
        made.append(line.event())
        return made[-1]

    clock = DeviceClock(torch.device("cpu"), event=event)
    for _ in range(50):
        clock.book(step(clock, line, 0.1, 1.0, decode=True))
    assert len(made) <= 4
    assert clock.stats()["decode_device_busy_time"] == pytest.approx(50.0)
    assert clock.stats()["decode_device_idle_time"] == pytest.approx(4.9)


def test_off_on_cpu_and_book_needs_an_end() -> None:
    clock = DeviceClock(torch.device("cpu"))
    assert not clock.enabled
    assert clock.begin(True) is None
    clock.book(None)
    assert clock.stats() == {}
    line = FakeTimeline()
    timed = DeviceClock(torch.device("cpu"), event=line.event)
    with pytest.raises(AssertionError, match="before end"):
        timed.book(timed.begin(True))


# -- the wiring in the loop ------------------------------------------------------------------------


class HostEvent:
    """An event that reads the host clock: on CPU a step's host time is its device time."""

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        assert self.t is not None

    def elapsed_time(self, other: HostEvent) -> float:
        assert self.t is not None and other.t is not None
        return (other.t - self.t) * 1e3


def run_timed(
    ckpt: Path, lookahead: bool, device: str, pause_s: float = 0.0
) -> tuple[dict[str, Any], list[Any], float]:
    """Two waves of requests, ``pause_s`` apart (the pause is not in the wall time)."""
    overrides = [
        f"device={device}",
        "graphs.backend=eager",
        f"lookahead.enable={str(lookahead).lower()}",
        "lookahead.min_batch=1",
    ]
    with LLM(model=ckpt, overrides=overrides) as llm:
        eng = llm.engine
        booked: list[Any] = []
        if device == "cpu":
            eng.recorder.clock = DeviceClock(torch.device("cpu"), event=HostEvent)
        real_book = eng.recorder.clock.book

        def book(marks: Any) -> None:
            # Booked events are recorded again later: keep what they read at booking.
            times = (marks.start.t, marks.end.t) if device == "cpu" else None
            booked.append((marks, times))
            real_book(marks)

        eng.recorder.clock.book = book  # type: ignore[method-assign]
        prompts = [[5 + i, 7, 9, 11 + i] for i in range(4)]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        wall = 0.0
        for wave in range(2):
            if wave:
                time.sleep(pause_s)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall += time.perf_counter() - t0
            assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
        return llm.stats(), booked, wall


@pytest.mark.parametrize("lookahead", [False, True], ids=["sync", "lookahead"])
def test_every_step_is_booked_once_in_launch_order(
    tiny_ckpts: dict[str, Path], lookahead: bool
) -> None:
    stats, booked, wall = run_timed(tiny_ckpts["llama"], lookahead, "cpu")
    steps = stats["prefill_steps"] + stats["decode_steps"]
    assert len(booked) == steps == stats["device_timed_steps"]
    assert len({id(m) for m, _ in booked}) == steps  # once each
    times = [t for _, t in booked]
    for (a_start, a_end), (b_start, _) in zip(times, times[1:], strict=False):
        assert a_start <= a_end <= b_start  # in launch order, and steps do not overlap
    assert sum(not m.decode for m, _ in booked) == stats["prefill_steps"]
    busy, idle = stats["decode_device_busy_time"], stats["decode_device_idle_time"]
    assert busy > 0
    assert busy + idle <= wall


@pytest.mark.parametrize("lookahead", [False, True], ids=["sync", "lookahead"])
def test_the_wait_between_runs_is_no_gap(tiny_ckpts: dict[str, Path], lookahead: bool) -> None:
    """The engine running dry ends a busy period: a pause between two ``generate`` calls does
    not show up as device idle time (in total, not only before decode steps)."""
    stats, _, wall = run_timed(tiny_ckpts["llama"], lookahead, "cpu", pause_s=0.5)
    assert stats["device_idle_time"] < 0.5
    assert stats["device_busy_time"] + stats["device_idle_time"] <= wall


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lookahead", [False, True], ids=["sync", "lookahead"])
def test_cuda_events_time_every_step(tiny_ckpts: dict[str, Path], lookahead: bool) -> None:
    stats, booked, wall = run_timed(tiny_ckpts["llama"], lookahead, "cuda", pause_s=0.5)
    steps = stats["prefill_steps"] + stats["decode_steps"]
    assert len(booked) == steps == stats["device_timed_steps"]
    assert 0 < stats["decode_device_busy_time"] <= stats["device_busy_time"]
    assert stats["decode_device_idle_time"] <= stats["device_idle_time"]
    assert stats["device_busy_time"] + stats["device_idle_time"] <= wall  # pause left out


def test_summary_reports_device_time(tiny_ckpts: dict[str, Path]) -> None:
    from hyloop.api.summary import render_summary

    with LLM(model=tiny_ckpts["llama"], overrides=["graphs.backend=eager"]) as llm:
        assert "device time" not in render_summary(llm)  # CPU: no events, no line
        llm.engine.recorder.clock = DeviceClock(torch.device("cpu"), event=HostEvent)
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        line = next(ln for ln in render_summary(llm).splitlines() if ln.startswith("device time"))
        assert "decode busy" in line and "idle between steps" in line
