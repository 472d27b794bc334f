"""What ``graphs.backend=auto`` captures for the job in front of it.

A captured artifact pays for itself when the steps it serves save more time than capturing it
costs: a cold CPU compile takes tens of seconds and needs thousands of steps to pay, a CUDA
graph a fraction of a second. ``auto`` therefore decides per job, when the engine goes from idle
to busy:

1. ``simulate`` the job's decode steps from what is queued and running (each request's
   context and the decode steps left in its budget, at most ``max_running`` at once, a finished
   request's place taken by the next waiting one) and count the steps each artifact key
   (batch bucket, ``kv_len`` bucket) would serve;
2. ``choose`` the keys whose estimated saving exceeds their estimated capture cost;
3. the runner captures exactly those, before the job's first step, and runs every other step
   eagerly. Nothing is captured later in the job, so no compile stalls the loop mid-run.

Budgets are upper bounds (a request may stop early), so the counts are too. Step times and
capture costs come from ``StepHistory`` (measured on this machine for this model), else from
``Estimates.defaults``.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hyloop.graphs.capture.buckets import pick_bucket

__all__ = ["Choice", "Estimates", "Outlook", "Plan", "choose", "key_label", "simulate"]


@dataclass(frozen=True)
class Outlook:
    """One request as the job's plan sees it."""

    kv_len: int  # columns its next decode step reads (its tokens so far)
    steps: int  # decode steps left at most (its remaining budget)


def simulate(
    requests: Iterable[Outlook],
    *,
    max_running: int,
    batch_buckets: Sequence[int],
    kv_bucket: Callable[[int], int | None],
) -> Counter[tuple[int, int]]:
    """Decode steps per artifact key ``(batch bucket, kv_len bucket)`` of a job.

    The first ``max_running`` requests decode together; when one finishes, the next waiting one
    joins. A step's ``kv_len`` is the longest row's; a batch above the largest bucket is split
    into pieces of that bucket (and one smaller piece). Steps past the largest ``kv_len`` bucket
    run eagerly whatever the plan, so they are not counted.
    """
    waiting = [[r.kv_len, r.steps] for r in requests if r.steps > 0]
    waiting.reverse()  # pop() takes the first in queue order
    running: list[list[int]] = []
    counts: Counter[tuple[int, int]] = Counter()
    largest = batch_buckets[-1]
    while running or waiting:
        while waiting and len(running) < max_running:
            running.append(waiting.pop())
        span = min(r[1] for r in running)
        n, base = len(running), max(r[0] for r in running)
        pieces = [largest] * (n // largest) + ([n % largest] if n % largest else [])
        t = 0
        while t < span:
            kb = kv_bucket(base + t)
            if kb is None:
                break
            run = min(span - t, kb - (base + t) + 1)
            for piece in pieces:
                b = pick_bucket(batch_buckets, piece)
                assert b is not None
                counts[(b, kb)] += run
            t += run
        for r in running:
            r[0] += span
            r[1] -= span
        running = [r for r in running if r[1] > 0]
    return counts


def _interpolate(known: Mapping[int, float], b: int) -> float | None:
    """``known[b]``, else linear between the nearest known buckets (flat beyond them)."""
    if not known:
        return None
    if b in known:
        return known[b]
    keys = sorted(known)
    i = bisect.bisect_left(keys, b)
    if i == 0:
        return known[keys[0]]
    if i == len(keys):
        return known[keys[-1]]
    lo, hi = keys[i - 1], keys[i]
    w = (b - lo) / (hi - lo)
    return known[lo] * (1 - w) + known[hi] * w


WARM_FRACTION = 0.15  # a compile whose FX graph is in inductor's cache: SmolLM2 ~7 s of ~50 s


def key_label(key: tuple[int, int]) -> str:
    return f"b{key[0]}_kv{key[1]}"


@dataclass
class Estimates:
    """Step times per batch bucket (ms) and capture costs (s).

    ``captures`` holds the capture times measured for each artifact key on this machine, oldest
    first: the first one compiled from nothing, later ones found inductor's on-disk cache warm.
    A key captured before is estimated at its warm cost (measured, else ``WARM_FRACTION`` of its
    first); a key never captured at the median first capture of the others, else the default.
    """

    eager_ms: dict[int, float] = field(default_factory=dict)
    captured_ms: dict[int, float] = field(default_factory=dict)
    captures: dict[str, list[float]] = field(default_factory=dict)
    default_eager_ms: Callable[[int], float] = lambda b: 40.0
    default_speedup: float = 1.35
    default_capture_s: float = 60.0
    measured: bool = False  # any figure above came from this machine

    @classmethod
    def defaults(
        cls, *, device: str, weight_bytes: int, num_layers: int, compile_in_graph: bool = False
    ) -> Estimates:
        """Rough figures for a model never measured here.

        CPU (``compile``): an eager step streams the weights at ~12 GB/s plus ~3% a row; the
        compiled step is ~1.35x faster; a cold compile costs ~10 s + 2 s a layer (SmolLM2, 30
        layers, on 2 cores: 40-74 s). CUDA (``cuda_graph``): an eager step is launch-bound, ~0.5
        ms a layer; the graph is ~4x faster; capturing costs ~0.5 s (measured on an H200:
        SmolLM2-shaped 14.9 vs 3.1 ms a step at batch 1), a compile inside it as on CPU.
        """
        if device == "cuda":
            cost = 10.0 + 2.0 * num_layers if compile_in_graph else 0.5
            return cls(
                default_eager_ms=lambda b: 0.5 * num_layers,
                default_speedup=4.0,
                default_capture_s=cost,
            )
        stream_ms = weight_bytes / 12e9 * 1e3
        return cls(
            default_eager_ms=lambda b: stream_ms * (1.0 + 0.03 * (b - 1)),
            default_speedup=1.35,
            default_capture_s=10.0 + 2.0 * num_layers,
        )

    def eager(self, b: int) -> float:
        got = _interpolate(self.eager_ms, b)
        return got if got is not None else self.default_eager_ms(b)

    def captured(self, b: int) -> float:
        got = _interpolate(self.captured_ms, b)
        if got is not None:
            return got
        return self.eager(b) / self.default_speedup

    def capture(self, key: tuple[int, int]) -> float:
        """Seconds capturing ``key`` would cost now."""
        seen = self.captures.get(key_label(key), [])
        if len(seen) > 1:
            return statistics.median(seen[1:])
        if seen:
            return seen[0] * WARM_FRACTION
        firsts = [times[0] for times in self.captures.values() if times]
        return statistics.median(firsts) if firsts else self.default_capture_s


@dataclass(frozen=True)
class Choice:
    key: tuple[int, int]  # (batch bucket, kv_len bucket)
    steps: int
    saving_s: float  # eager minus captured time over those steps
    cost_s: float  # estimated capture time

    @property
    def pays(self) -> bool:
        return self.saving_s > self.cost_s


@dataclass
class Plan:
    """What ``auto`` decided for one job: the keys it captures and why."""

    choices: list[Choice]
    measured: bool  # estimates came (partly) from this machine's history

    @property
    def captured(self) -> list[tuple[int, int]]:
        return [c.key for c in self.choices if c.pays]

    @property
    def steps(self) -> int:
        return sum(c.steps for c in self.choices)

    def summary(self) -> str:
        """One line: how many keys were worth capturing, and the estimated trade."""
        take = [c for c in self.choices if c.pays]
        saving = sum(c.saving_s for c in take)
        cost = sum(c.cost_s for c in take)
        best = max(self.choices, key=lambda c: c.saving_s - c.cost_s, default=None)
        source = "measured here" if self.measured else "default estimates"
        head = f"{len(take)} of {len(self.choices)} artifacts for ~{self.steps} decode steps"
        if take:
            return f"{head} (est. {cost:.1f} s to capture, {saving:.1f} s saved; {source})"
        if best is None:
            return f"{head} (no decode steps planned)"
        return (
            f"{head} (the best, {best.steps} steps at batch {best.key[0]}, would save "
            f"{best.saving_s:.1f} s for {best.cost_s:.1f} s of capture; {source})"
        )


def choose(
    counts: Mapping[tuple[int, int], int],
    est: Estimates,
    have: Collection[tuple[int, int]] = (),
) -> Plan:
    """A choice per key: capture it when its steps save more than its capture costs (nothing
    for a key in ``have``, already captured)."""
    choices = []
    for key, steps in sorted(counts.items()):
        b = key[0]
        saving = steps * max(0.0, est.eager(b) - est.captured(b)) / 1e3
        choices.append(Choice(key, steps, saving, 0.0 if key in have else est.capture(key)))
    return Plan(choices, est.measured)
