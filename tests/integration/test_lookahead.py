"""Async lookahead: the same tokens as the synchronous loop, and nothing freed too early.

Lookahead launches decode step N+1 before step N is resolved, so everything the host does (stop
checks, tree inserts, frees) runs one step late. These tests run each workload twice, lookahead
off and on, through a pool small enough to queue requests and evict the cache, and check:
identical tokens and finish reasons (greedy and seeded sampling, dense and hybrid, eager and
compile), the pool/tree ledger after every step, no token past a stop or ``max_tokens`` in an
output or in the tree, and that a page freed while the launched step still reads it is caught.

Aborts are keyed on how many tokens a request has returned, not on the step number (which is
one apart under lookahead), so both runs abort the same requests with the same outputs.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from hyloop import LLM, RequestOutput, SamplingParams
from hyloop.framework.engine import Engine
from hyloop.framework.requests import Batch

EOS = 2

MIN1 = "lookahead.min_batch=1"  # exercise the lookahead path at every batch size


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread() -> Any:
    """Tiny models run fastest on one thread; with the lookahead thread beside the step, a
    second OpenMP worker only spins against it on a small machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rand_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


@dataclass
class Job:
    rid: str
    prompt: list[int]
    params: SamplingParams
    abort_at: int | None = None  # abort once this many tokens are returned (0: before step 1)


@dataclass
class Run:
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    steps: int = 0
    checks: int = 0
    evicted_tokens: int = 0
    max_waiting_while_running: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


def make_jobs(
    n: int, seed: int, shared: bool, max_tokens: int = 24, abort_rate: float = 0.15
) -> list[Job]:
    """Mixed greedy and seeded sampling, some stop ids, some aborts keyed on the number of
    returned tokens. ``shared``: prompts are cut from a few common bases, so admissions hit
    the cache; otherwise prompts are distinct and the tree only fills and evicts."""
    rng = random.Random(seed)
    bases = [rand_ids(rng.randint(16, 48), 1000 * seed + i) for i in range(4)]
    jobs = []
    for i in range(n):
        head = rng.choice(bases)[: rng.randint(1, 48)] if shared else []
        prompt = head + rand_ids(rng.randint(1, 32), 1000 * seed + 100 + i)
        stop = [rng.randint(3, 255) for _ in range(2)] if rng.random() < 0.3 else None
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.9]),
            seed=i,
            max_tokens=rng.randint(1, max_tokens),
            stop_token_ids=stop,
            ignore_eos=rng.random() < 0.5,
        )
        abort = None
        if i % 6 == 1:  # early enough to land before most stops: 0 aborts while waiting
            abort = min(i % 4, params.max_tokens - 1)
        elif rng.random() < abort_rate:
            abort = rng.randint(0, params.max_tokens - 1)
        jobs.append(Job(f"r{i}", prompt, params, abort))
    return jobs


def drive(
    eng: Engine,
    jobs: list[Job],
    check_every: int = 1,
    on_step: Callable[[Engine], None] | None = None,
) -> Run:
    """Add ``jobs``, step until done, abort on schedule, check the ledger every few steps."""
    run = Run()
    real_evict = eng.cache.tree.evict

    def counting_evict(params: Any) -> Any:
        r = real_evict(params)
        run.evicted_tokens += r.num_tokens_evicted
        return r

    eng.cache.tree.evict = counting_evict  # type: ignore[method-assign]
    pending = {j.rid: j.abort_at for j in jobs if j.abort_at is not None}
    for j in jobs:
        eng.add_request(j.rid, j.prompt, j.params)
    try:
        while eng.has_unfinished_requests() or pending:
            for rid, at in list(pending.items()):
                req = eng.request(rid)
                if req is None:
                    del pending[rid]  # finished before its abort point
                elif len(req.output_ids) >= at:
                    eng.abort_request(rid)
                    del pending[rid]
            for out in eng.step():
                assert not (out.finished and out.request_id in run.outputs), out.request_id
                if out.finished:
                    run.outputs[out.request_id] = out
            run.steps += 1
            if run.steps % check_every == 0:
                eng.check_invariants()
                run.checks += 1
            if on_step is not None:
                on_step(eng)
            if eng.scheduler.running:
                waiting = len(eng.scheduler.waiting)
                run.max_waiting_while_running = max(run.max_waiting_while_running, waiting)
            assert run.steps < 20_000, "the engine does not make progress"
    finally:
        eng.cache.tree.evict = real_evict  # type: ignore[method-assign]
    eng.check_invariants()
    run.stats = eng.stats()
    return run


def run_pair(ckpt: Path, overrides: list[str], jobs: list[Job]) -> tuple[Run, Run]:
    runs = []
    for enable in (False, True):
        with LLM(model=ckpt, overrides=[*overrides, f"lookahead.enable={enable}", MIN1]) as llm:
            runs.append(drive(llm.engine, jobs))
    return runs[0], runs[1]


def assert_same_outputs(sync: Run, la: Run, jobs: list[Job]) -> None:
    assert sorted(sync.outputs) == sorted(la.outputs) == sorted(j.rid for j in jobs)
    for j in jobs:
        a, b = sync.outputs[j.rid].outputs[0], la.outputs[j.rid].outputs[0]
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason), j.rid


def ledger_is_closed(eng: Engine) -> None:
    """Every page and slot is free or owned by the tree; nothing left pending."""
    alloc = eng.cache.kv
    assert alloc.pending_size() == 0
    assert alloc.available_size() + eng.cache.tree.total_size() == alloc.capacity
    rec = eng.cache.recurrent
    if rec is not None:
        assert rec.pending_size() == 0
        assert rec.available_size() + eng.cache.tree.total_size("recurrent") == rec.capacity


# -- lookahead on == off ---------------------------------------------------------------------------

SMALL_POOL = [
    "kv_pool.page_size=4",
    "kv_pool.num_pages=48",  # 188 tokens: a few requests at a time, the tree evicts
    "scheduler.max_running_requests=6",
    "scheduler.prefill_chunk=16",
    "model.max_context=128",
]


HYBRID_35 = ["recurrent_pool.num_slots=10", "recurrent_pool.track_interval=16"]
HYBRID_NEXT = ["recurrent_pool.track_interval=8"]
# (family, arch, overrides, requests, shared prefixes): shared prompts make admissions hit the
# cache (and evict around their hits); distinct prompts only fill and evict the tree.
CASES = [
    pytest.param(family, arch, extra, n, shared, id=f"{arch}-{'shared' if shared else 'distinct'}")
    for family, arch, extra, n in (
        ("dense", "llama", [], 40),
        ("dense", "qwen3", [], 32),
        ("hybrid", "qwen3_5", HYBRID_35, 24),
        ("hybrid", "qwen3_next", HYBRID_NEXT, 24),
    )
    for shared in (False, True)
]


@pytest.mark.parametrize(("family", "arch", "extra", "n", "shared"), CASES)
def test_eager_outputs_match_sync(
    tiny_ckpts: dict[str, Path],
    hybrid_ckpts: dict[str, Path],
    family: str,
    arch: str,
    extra: list[str],
    n: int,
    shared: bool,
) -> None:
    ckpt = (tiny_ckpts if family == "dense" else hybrid_ckpts)[arch]
    jobs = make_jobs(n, seed=len(arch), shared=shared)
    sync, la = run_pair(ckpt, [*SMALL_POOL, "graphs.backend=eager", *extra], jobs)
    assert_same_outputs(sync, la, jobs)
    for run in (sync, la):
        assert run.checks == run.steps  # the ledger was checked after every step
        assert run.evicted_tokens > 0 and run.max_waiting_while_running > 0
        assert run.stats["requests_aborted"] >= 1
        assert (run.stats["cached_tokens"] > 0) == shared
    assert la.stats["lookahead_hidden_host_s"] > 0  # resolves really ran behind a launch


def test_compile_outputs_match_sync(tiny_ckpts: dict[str, Path]) -> None:
    """One compiled engine (buckets 2 and 4), its jobs run with the sync loop, then, the cache
    emptied, with lookahead on the same artifacts: a few requests, one abort, greedy and
    seeded."""
    jobs = make_jobs(6, seed=5, shared=False, max_tokens=12, abort_rate=0.0)
    jobs[1].abort_at = 3
    overrides = [
        *SMALL_POOL[:-2],
        "scheduler.max_running_requests=4",
        "model.max_context=96",
        "graphs.backend=compile",
        "graphs.buckets=[2,4]",
        "lookahead.enable=false",
        MIN1,
    ]
    runs = []
    with LLM(model=tiny_ckpts["llama"], overrides=overrides) as llm:
        for enable in (False, True):
            llm.llm_engine.set_lookahead(enable)
            assert llm.reset_prefix_cache()  # the second loop computes every prefix anew
            before = llm.stats()
            runs.append(drive(llm.engine, jobs))
            after = runs[-1].stats
            assert after["graph_replays"] > before["graph_replays"]
            assert after["recompiles"] == 0
    sync, la = runs
    assert_same_outputs(sync, la, jobs)
    assert la.stats["lookahead_hidden_host_s"] > sync.stats.get("lookahead_hidden_host_s", 0.0)


# -- stress: 500 requests, nothing leaks, nothing past a stop --------------------------------------


def tree_paths(eng: Engine) -> list[bytes]:
    """Packed token ids of every root-to-leaf path of the UHRC."""
    paths: list[bytes] = []
    stack = [(child, b"") for child in eng.cache.tree.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        path = prefix + node.key
        if node.children:
            stack.extend((child, path) for child in node.children.values())
        else:
            paths.append(path)
    return paths


def assert_outputs_respect_limits(jobs: list[Job], outputs: dict[str, RequestOutput]) -> None:
    for j in jobs:
        out = outputs[j.rid].outputs[0]
        ids = out.token_ids
        stops = set(j.params.stop_token_ids or []) | (set() if j.params.ignore_eos else {EOS})
        assert len(ids) <= j.params.max_tokens, j.rid
        assert not stops.intersection(ids[:-1]), f"{j.rid}: token after a stop id: {ids}"
        if out.finish_reason == "stop":
            assert ids and ids[-1] in stops, j.rid
        elif out.finish_reason == "length":  # vLLM checks the length first: a stop id may end it
            assert len(ids) == j.params.max_tokens, j.rid
        else:
            assert out.finish_reason == "abort" and not stops.intersection(ids), j.rid


def assert_tree_holds_only_returned_tokens(eng: Engine, outputs: dict[str, RequestOutput]) -> None:
    """Every tree key is a prefix of some request's prompt + returned output: the token a
    finished request produced one step late (after a stop id or at max_tokens) is never there."""
    seqs = [
        array("q", o.prompt_token_ids + o.outputs[0].token_ids).tobytes() for o in outputs.values()
    ]
    paths = tree_paths(eng)
    assert paths, "the tree is empty: nothing was checked"
    for path in paths:
        if not any(s.startswith(path) for s in seqs):
            ids = list(array("q", path))
            raise AssertionError(f"tree key of {len(ids)} tokens is no returned sequence: {ids}")


def stress_jobs(n: int, seed: int, max_tokens: int) -> tuple[list[Job], dict[int, str]]:
    rng = random.Random(seed)
    bases = [rand_ids(rng.randint(8, 60), 500 + i) for i in range(8)]
    jobs, aborts = [], {}
    for i in range(n):
        prompt = rng.choice(bases)[: rng.randint(0, 60)] + rand_ids(rng.randint(1, 40), 7 * i)
        stop = rng.sample(range(3, 256), rng.randint(1, 6)) if rng.random() < 0.4 else None
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.0, 1.0]),
            seed=i,
            max_tokens=rng.randint(1, max_tokens),
            stop_token_ids=stop,
            ignore_eos=rng.random() < 0.3,
        )
        jobs.append(Job(f"s{i}", prompt, params))
        if rng.random() < 0.1:
            aborts.setdefault(rng.randint(0, 40 * n // 32), f"s{i}")
    return jobs, aborts


def drive_with_step_aborts(eng: Engine, jobs: list[Job], aborts: dict[int, str]) -> Run:
    step = 0

    def abort_on_schedule(e: Engine) -> None:
        nonlocal step
        step += 1
        if step in aborts:
            e.abort_request(aborts[step])

    return drive(eng, jobs, check_every=5, on_step=abort_on_schedule)


def test_stress_500_requests_dense(tiny_ckpts: dict[str, Path]) -> None:
    jobs, aborts = stress_jobs(500, seed=3, max_tokens=64)
    overrides = [
        "graphs.backend=eager",
        "kv_pool.page_size=1",  # the tree keeps every token: the strictest post-stop check
        "kv_pool.num_pages=3000",
        "scheduler.max_running_requests=32",
        "scheduler.prefill_chunk=64",
        "model.max_context=160",
        "lookahead.enable=true",
        MIN1,
    ]
    with LLM(model=tiny_ckpts["llama"], overrides=overrides) as llm:
        eng = llm.engine
        run = drive_with_step_aborts(eng, jobs, aborts)
        assert eng.lookahead_enabled and not eng.pipeline.unresolved()
        ledger_is_closed(eng)
        assert_tree_holds_only_returned_tokens(eng, run.outputs)
    assert len(run.outputs) == len(jobs)
    assert_outputs_respect_limits(jobs, run.outputs)
    reasons = {o.outputs[0].finish_reason for o in run.outputs.values()}
    assert reasons == {"stop", "length", "abort"}
    assert run.evicted_tokens > 0 and run.max_waiting_while_running > 0


def test_stress_hybrid_ledger(hybrid_ckpts: dict[str, Path]) -> None:
    """The hybrid variant: state slots and track snapshots come back too."""
    jobs, aborts = stress_jobs(100, seed=4, max_tokens=32)
    overrides = [
        "graphs.backend=eager",
        "kv_pool.page_size=1",
        "kv_pool.num_pages=1200",
        "recurrent_pool.num_slots=24",
        "recurrent_pool.track_interval=16",
        "scheduler.max_running_requests=12",
        "scheduler.prefill_chunk=64",
        "model.max_context=128",
        "lookahead.enable=true",
        MIN1,
    ]
    with LLM(model=hybrid_ckpts["qwen3_5"], overrides=overrides) as llm:
        eng = llm.engine
        run = drive_with_step_aborts(eng, jobs, aborts)
        ledger_is_closed(eng)
        assert eng.cache.tree.total_size("recurrent") > 0  # snapshots were committed and kept
        assert_tree_holds_only_returned_tokens(eng, run.outputs)
    assert len(run.outputs) == len(jobs)
    assert_outputs_respect_limits(jobs, run.outputs)


# -- a page freed while the launched step reads it is caught ---------------------------------------

EARLY_FREE = [
    "graphs.backend=eager",
    "kv_pool.page_size=4",
    "kv_pool.num_pages=64",
    "scheduler.max_running_requests=4",
    "lookahead.enable=true",
    MIN1,
]


def launch_decode(eng: Engine, n: int) -> None:
    for i in range(n):
        eng.add_request(
            f"e{i}", rand_ids(6 + 5 * i, 40 + i), SamplingParams(temperature=0.0, max_tokens=30)
        )
    for _ in range(10):
        eng.step()
        eng.check_invariants()
        if inflight_decode(eng) is not None:
            return
    raise AssertionError("no decode step was launched")


def inflight_decode(eng: Engine) -> Batch | None:
    """The batch of the oldest launched decode step not yet resolved."""
    assert eng.lookahead_enabled
    batches = [p.batch for p in eng.pipeline.unresolved()]
    return next((b for b in batches if b.is_decode), None)


def read_page_slot(eng: Engine) -> int:
    """A slot of a page the in-flight step reads, owned by the request (not the tree)."""
    batch = inflight_decode(eng)
    assert batch is not None
    chunk = batch.chunks[0]
    lease = chunk.req.lease
    assert lease is not None and chunk.start >= lease.own_from
    return int(lease.slots[chunk.start])


def test_page_freed_under_a_launched_step_is_caught(tiny_ckpts: dict[str, Path]) -> None:
    with LLM(model=tiny_ckpts["llama"], overrides=EARLY_FREE) as llm:
        eng = llm.engine
        launch_decode(eng, 3)
        # Bypass the deferral: a free outside the fence puts the page straight on the free list.
        alloc = eng.cache.kv
        fence, alloc.fence = alloc.fence, None
        alloc.free(torch.tensor([read_page_slot(eng)]))
        alloc.fence = fence
        with pytest.raises(AssertionError, match="still reads it"):
            eng.check_invariants()


def test_pending_flushed_early_is_caught(tiny_ckpts: dict[str, Path]) -> None:
    with LLM(model=tiny_ckpts["llama"], overrides=EARLY_FREE) as llm:
        eng = llm.engine
        launch_decode(eng, 3)
        batch = inflight_decode(eng)
        assert batch is not None
        victim = batch.chunks[0].req
        # The normal path: an abort during flight parks the request's pages as pending-free.
        eng.abort_request(victim.request_id)
        assert eng.cache.kv.pending_size() > 0
        eng.check_invariants()
        # Releasing them before the launched step completed is the bug the check exists for.
        eng.cache.kv.flush_pending()
        with pytest.raises(AssertionError, match="still reads it"):
            eng.check_invariants()


def test_abort_during_flight_is_deferred_and_clean(tiny_ckpts: dict[str, Path]) -> None:
    with LLM(model=tiny_ckpts["llama"], overrides=EARLY_FREE) as llm:
        eng = llm.engine
        launch_decode(eng, 3)
        eng.abort_request("e1")
        pending = eng.cache.kv.pending_size()
        assert pending > 0
        eng.check_invariants()
        eng.step()  # resolves the step that still read e1's pages: they become free
        eng.check_invariants()
        assert eng.cache.kv.pending_size() < pending
        while eng.has_unfinished_requests():
            eng.step()
            eng.check_invariants()
        ledger_is_closed(eng)


# -- hybrid: a request stopped under lookahead leaves a reusable, exact prefix ---------------------

TRACK = 16
HYBRID_TURNS = [
    "graphs.backend=eager",
    "kv_pool.page_size=16",
    f"recurrent_pool.track_interval={TRACK}",
    "scheduler.prefill_chunk=32",
    "model.max_context=256",
]


def run_one(eng: Engine, rid: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
    eng.add_request(rid, prompt, params)
    req = eng.request(rid)
    assert req is not None
    done = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done = out
        eng.check_invariants()
    assert done is not None
    done.logits = req.logits  # type: ignore[attr-defined]
    return done


def test_hybrid_stop_then_extend_hits_an_exact_track_snapshot(
    hybrid_ckpts: dict[str, Path],
) -> None:
    ckpt = hybrid_ckpts["qwen3_5"]
    turn1 = rand_ids(40, 77)
    tail = rand_ids(7, 78)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results: dict[tuple[bool, bool], tuple[RequestOutput, RequestOutput]] = {}
    stop_id: int | None = None
    for lookahead, cache in ((False, False), (True, True), (False, True)):
        overrides = [*HYBRID_TURNS, f"lookahead.enable={lookahead}", MIN1, f"cache.enable={cache}"]
        with LLM(model=ckpt, overrides=overrides) as llm:
            eng = llm.engine
            eng.capture_logits = True
            if stop_id is None:
                # A stop id the model really produces: the first new token from the 27th on,
                # so turn 1 covers prompt + output past the boundary at 64.
                probe = run_one(eng, "probe", turn1, greedy).outputs[0].token_ids
                k = next(i for i in range(26, len(probe)) if probe[i] not in probe[:i])
                stop_id = probe[k]
            params = SamplingParams(
                temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id]
            )
            out1 = run_one(eng, "t1", turn1, params)
            sample1 = out1.outputs[0]
            assert sample1.finish_reason == "stop" and sample1.token_ids[-1] == stop_id
            turn2 = turn1 + sample1.token_ids + tail
            out2 = run_one(
                eng, "t2", turn2, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            )
            results[(lookahead, cache)] = (out1, out2)
            ledger_is_closed(eng)
    ref1, ref2 = results[(False, False)]
    assert ref2.num_cached_tokens == 0
    for key in ((True, True), (False, True)):
        out1, out2 = results[key]
        assert out1.outputs[0].token_ids == ref1.outputs[0].token_ids, key
        assert out2.outputs[0].token_ids == ref2.outputs[0].token_ids, key
        # The hit ends on a track boundary inside turn 1's prompt + returned output.
        end1 = len(turn1) + len(out1.outputs[0].token_ids)
        assert 0 < out2.num_cached_tokens <= end1 and out2.num_cached_tokens % TRACK == 0, key
        for a, b in zip(out2.logits, ref2.logits, strict=True):  # type: ignore[attr-defined]
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert results[(True, True)][1].num_cached_tokens >= 64
