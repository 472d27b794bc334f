"""``graphs.backend=auto``'s job plan: simulated decode steps per artifact, the choice, history."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hyloop.graphs.capture.auto_plan import WARM_FRACTION, Estimates, Outlook, choose, simulate
from hyloop.graphs.capture.buckets import kv_len_buckets, pick_bucket
from hyloop.graphs.capture.policy import StepHistory

BUCKETS = (1, 2, 4, 8)


def kv16(kv_len: int) -> int | None:
    return pick_bucket(kv_len_buckets(128, multiple=16), kv_len)


def run(requests: list[Outlook], max_running: int = 8) -> dict[tuple[int, int], int]:
    return dict(simulate(requests, max_running=max_running, batch_buckets=BUCKETS, kv_bucket=kv16))


def test_one_request_walks_the_kv_buckets() -> None:
    # kv_len 10..49: 7 steps in bucket 16, then 16 in 32, then 16 in 48, then 1 in 64.
    assert run([Outlook(10, 40)]) == {(1, 16): 7, (1, 32): 16, (1, 48): 16, (1, 64): 1}


def test_the_batch_shrinks_as_requests_finish() -> None:
    # Three requests of 5, 5 and 20 steps: 5 steps at batch 3 (bucket 4), then 15 at batch 1.
    got = run([Outlook(4, 5), Outlook(4, 5), Outlook(4, 20)])
    assert got == {(4, 16): 5, (1, 16): 8, (1, 32): 7}  # kv_len 9..16, then 17..23
    assert sum(got.values()) == 20


def test_waiting_requests_take_finished_places() -> None:
    # max_running 2: two run 3 steps, then the third runs its 3 steps alone.
    got = run([Outlook(2, 3), Outlook(2, 3), Outlook(2, 3)], max_running=2)
    assert got == {(2, 16): 3, (1, 16): 3}


def test_a_batch_above_the_largest_bucket_is_split() -> None:
    got = run([Outlook(2, 4)] * 11, max_running=16)
    assert got == {(8, 16): 4, (4, 16): 4}  # pieces of 8 and 3


def test_steps_past_the_largest_kv_bucket_are_not_counted() -> None:
    assert sum(run([Outlook(120, 50)]).values()) == 9  # kv_len 120..128


def test_a_key_is_captured_only_when_its_steps_pay_for_it() -> None:
    est = Estimates(default_eager_ms=lambda b: 40.0, default_speedup=2.0, default_capture_s=5.0)
    # 20 ms saved a step: 250 steps pay for a 5 s capture, 200 do not.
    plan = choose({(1, 16): 300, (4, 16): 200}, est)
    assert plan.captured == [(1, 16)]
    assert "1 of 2 artifacts" in plan.summary()
    # An artifact already captured costs nothing.
    assert choose({(4, 16): 200}, est, have={(4, 16)}).captured == [(4, 16)]


def test_measured_figures_replace_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "steps" / "m.json"
    history = StepHistory(path)
    for _ in range(5):
        history.record_step("eager", 4, 0.050)
        history.record_step("compile", 4, 0.020)
    history.record_step("eager", 16, 0.080)  # too few samples: not kept
    history.record_capture("compile", (4, 32), 40.0)  # from nothing
    history.record_capture("compile", (4, 32), 12.0)  # again, inductor's cache warm
    history.record_capture("compile", (4, 16), 60.0)
    history.save()
    again = StepHistory(path)
    assert again.step_ms["eager"] == {4: 50.0} and again.step_ms["compile"] == {4: 20.0}
    est = again.estimates("compile", Estimates(default_capture_s=99.0))
    assert est.measured
    assert est.capture((4, 32)) == 12.0  # its measured warm cost
    assert est.capture((4, 16)) == pytest.approx(60.0 * WARM_FRACTION)  # compiled once
    assert est.capture((8, 16)) == 50.0  # never compiled: the median cold compile
    assert est.eager(4) == pytest.approx(50.0) and est.captured(4) == pytest.approx(20.0)
    assert est.eager(8) == pytest.approx(50.0)  # flat beyond the measured buckets
    # 30 ms a step saved: 400 steps (12 s) pay for the 12 s capture only just not, 401 do.
    assert choose({(4, 32): 400}, est).captured == []
    assert choose({(4, 32): 401}, est).captured == [(4, 32)]
    assert choose({(4, 32): 401}, Estimates(default_capture_s=99.0)).captured == []


def test_history_keeps_the_first_and_latest_captures(tmp_path: Path) -> None:
    history = StepHistory(tmp_path / "h.json")
    for t in (50.0, 9.0, 8.0, 7.0, 6.0, 5.0):
        history.record_capture("compile", (1, 256), t)
    assert history.capture_s["compile"]["b1_kv256"] == [50.0, 7.0, 6.0, 5.0]


def test_interpolates_between_measured_buckets(tmp_path: Path) -> None:
    history = StepHistory(tmp_path / "h.json")
    history.step_ms["eager"].update({2: 20.0, 8: 80.0})
    est = history.estimates("compile", Estimates())
    assert est.eager(4) == pytest.approx(40.0)


def test_an_unreadable_history_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    path.write_text("{not json")
    history = StepHistory(path)
    assert not history.step_ms and not history.capture_s
    history.record_capture("compile", (2, 16), 3.0)
    history.save()
    assert json.loads(path.read_text())["capture_s"] == {"compile": {"b2_kv16": [3.0]}}


def test_a_captured_step_measured_slower_than_eager_is_never_chosen(tmp_path: Path) -> None:
    """A forced slow candidate: on a machine whose compiled step measured slower than eager
    (as a spinning-OpenMP compiled step beside a busy process is), no job is long enough for
    ``auto`` to capture it, even with the capture itself free."""
    history = StepHistory(tmp_path / "h.json")
    for _ in range(5):
        history.record_step("eager", 1, 0.040)
        history.record_step("compile", 1, 0.045)
    history.record_capture("compile", (1, 16), 0.0)
    history.save()  # the step samples become figures
    est = history.estimates("compile", Estimates())
    assert est.captured(1) > est.eager(1)
    assert choose({(1, 16): 1_000_000}, est).captured == []
    assert choose({(1, 16): 1_000_000}, est, have={(1, 16)}).captured == []
