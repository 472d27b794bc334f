"""More requests than the pool holds: they queue, all complete, nothing leaks.

Forty requests of varied prompt and output lengths (some sharing prefixes, so the cache has
something to reuse and evict) run through a pool that holds only a few of them at once. After
every ``step()`` the pool/tree ledger is checked; at the end every KV page is free or owned by the
cache tree, and every request's tokens equal those of the same request run with a large pool
by the plain loop (the oracle), with the cache on and off, with and without lookahead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hyloop import LLM, SamplingParams

NUM_REQUESTS = 40
MAX_RUNNING = 4
PAGE_SIZE = 4
# Page 0 is the padding sink; 24 usable pages (96 tokens) hold one to four requests at a time.
SMALL_POOL = 25
COMMON = [
    "graphs.backend=eager",
    f"kv_pool.page_size={PAGE_SIZE}",
    "model.max_context=64",
    "scheduler.prefill_chunk=8",
]


def workload() -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 256, (12,), generator=g).tolist()
    reqs = []
    for i in range(NUM_REQUESTS):
        n = int(torch.randint(1, 30, (1,), generator=g))
        tail = torch.randint(3, 256, (n,), generator=g).tolist()
        prompt = shared + tail if i % 3 == 0 else tail  # a third share a 12-token prefix
        max_tokens = int(torch.randint(1, 20, (1,), generator=g))
        if i % 2:
            sp = SamplingParams(temperature=0.9, seed=i, max_tokens=max_tokens, ignore_eos=True)
        else:
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        reqs.append((prompt, sp))
    return reqs


@pytest.fixture(
    scope="module",
    params=[pytest.param(True, id="cache"), pytest.param(False, id="no-cache")],
)
def cache_enable(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture(scope="module", params=[False, True], ids=["plain-loop", "lookahead"])
def lookahead(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture(scope="module")
def reference(tiny_ckpts: dict[str, Path], cache_enable: bool) -> list[list[int]]:
    overrides = [*COMMON, "kv_pool.num_pages=2048", f"cache.enable={str(cache_enable).lower()}"]
    reqs = workload()
    with LLM(model=tiny_ckpts["llama"], overrides=overrides) as llm:
        outs = llm.generate([p for p, _ in reqs], [s for _, s in reqs], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# Every 7th request is aborted at some step: while waiting, prefilling or decoding.
ABORTS = {
    step: [f"q{i}"]
    for i, step in zip(range(0, NUM_REQUESTS, 7), (0, 3, 9, 17, 30, 50), strict=True)
}


def run_small_pool(
    ckpt: Path, cache_enable: bool, lookahead: bool, aborts: dict[int, list[str]] | None = None
) -> dict[str, Any]:
    """Run the workload through a small pool, stepping by hand and checking after each step."""
    overrides = [
        *COMMON,
        f"kv_pool.num_pages={SMALL_POOL}",
        f"scheduler.max_running_requests={MAX_RUNNING}",
        f"cache.enable={str(cache_enable).lower()}",
        f"lookahead.enable={str(lookahead).lower()}",
        "lookahead.min_batch=1",
    ]
    llm = LLM(model=ckpt, overrides=overrides)
    try:
        return _run(llm, aborts or {})
    except Exception as e:  # reported by every test of this configuration, not as a setup error
        return {"error": e}
    finally:
        llm.close()


@pytest.fixture(scope="module")
def queued_run(tiny_ckpts: dict[str, Path], cache_enable: bool, lookahead: bool) -> dict[str, Any]:
    return run_small_pool(tiny_ckpts["llama"], cache_enable, lookahead)


@pytest.fixture(scope="module")
def aborted_run(tiny_ckpts: dict[str, Path], cache_enable: bool, lookahead: bool) -> dict[str, Any]:
    return run_small_pool(tiny_ckpts["llama"], cache_enable, lookahead, ABORTS)


def _run(llm: LLM, aborts: dict[int, list[str]]) -> dict[str, Any]:
    eng = llm.engine
    for i, (prompt, sp) in enumerate(workload()):
        eng.add_request(f"q{i}", prompt, sp)
    done: dict[str, Any] = {}
    max_running = max_waiting_while_running = 0
    unfinished_flags: list[tuple[bool, int]] = []
    steps = 0
    while eng.has_unfinished_requests():
        for rid in aborts.get(steps, []):
            eng.abort_request(rid)
        outs = eng.step()
        steps += 1
        eng.check_invariants()
        for out in outs:
            assert not (out.finished and out.request_id in done), f"{out.request_id} twice"
            if out.finished:
                done[out.request_id] = out
        running = len(eng.scheduler.running)
        max_running = max(max_running, running)
        if running:
            max_waiting_while_running = max(max_waiting_while_running, len(eng.scheduler.waiting))
        unfinished_flags.append((eng.has_unfinished_requests(), len(done)))
        assert steps < 5000, "the engine does not make progress"
    return {
        "done": done,
        "max_running": max_running,
        "max_waiting_while_running": max_waiting_while_running,
        "unfinished_flags": unfinished_flags,
        "stats": llm.stats(),
    }


def ran(queued_run: dict[str, Any]) -> dict[str, Any]:
    if "error" in queued_run:
        raise AssertionError(f"the queued run failed: {queued_run['error']!r}")
    return queued_run


def test_all_requests_complete_with_the_large_pool_tokens(
    queued_run: dict[str, Any], reference: list[list[int]]
) -> None:
    done = ran(queued_run)["done"]
    assert sorted(done) == sorted(f"q{i}" for i in range(NUM_REQUESTS))
    for i, (_, sp) in enumerate(workload()):
        out = done[f"q{i}"].outputs[0]
        assert out.finish_reason == "length"
        assert len(out.token_ids) == sp.max_tokens
        assert out.token_ids == reference[i], f"request q{i}"


def test_the_pool_forced_queueing(queued_run: dict[str, Any]) -> None:
    assert ran(queued_run)["max_running"] <= MAX_RUNNING
    assert queued_run["max_waiting_while_running"] > 0


def test_every_page_is_free_or_in_the_tree_at_the_end(
    queued_run: dict[str, Any], cache_enable: bool
) -> None:
    stats = ran(queued_run)["stats"]
    assert stats["kv_capacity_tokens"] == (SMALL_POOL - 1) * PAGE_SIZE
    held_by_tree = stats["cache_evictable_tokens"]
    assert stats["kv_free_tokens"] + held_by_tree == stats["kv_capacity_tokens"]
    if not cache_enable:
        assert held_by_tree == 0


def test_unfinished_until_the_last_output_is_returned(queued_run: dict[str, Any]) -> None:
    for still_unfinished, returned in ran(queued_run)["unfinished_flags"]:
        assert still_unfinished == (returned < NUM_REQUESTS)


def test_aborts_under_pressure_harm_no_other_request(
    aborted_run: dict[str, Any], reference: list[list[int]]
) -> None:
    done = ran(aborted_run)["done"]
    assert len(done) == NUM_REQUESTS
    aborted = {rid for rids in ABORTS.values() for rid in rids}
    for i in range(NUM_REQUESTS):
        out = done[f"q{i}"]
        sample = out.outputs[0]
        if sample.finish_reason == "abort":
            assert out.request_id in aborted
            assert sample.token_ids == reference[i][: len(sample.token_ids)]
        else:
            assert sample.token_ids == reference[i], f"request q{i}"
    assert sum(o.outputs[0].finish_reason == "abort" for o in done.values()) >= 3
    stats = aborted_run["stats"]
    assert stats["kv_free_tokens"] + stats["cache_evictable_tokens"] == stats["kv_capacity_tokens"]


def test_admission_never_evicts_its_own_prefix_hit(tiny_ckpts: dict[str, Path]) -> None:
    # 16 usable pages of 4. The tree holds an unlocked 32-token prefix (8 pages), a running
    # request holds 4 pages, and a request extending the prefix needs 8 more: the only thing
    # eviction could take is that request's own hit. It must wait instead, then run.
    overrides = [
        "graphs.backend=eager",
        "kv_pool.page_size=4",
        "kv_pool.num_pages=17",
        "model.max_context=128",
        "lookahead.enable=false",
    ]
    prefix = list(range(100, 132))
    with LLM(model=tiny_ckpts["llama"], overrides=overrides) as llm:
        eng = llm.engine
        llm.generate([prefix], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        assert llm.stats()["cache_evictable_tokens"] == 32
        eng.add_request(
            "running", [7] * 8, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        )
        eng.step()
        long = SamplingParams(temperature=0.0, max_tokens=31, ignore_eos=True)
        eng.add_request("extends", [*prefix, 5], long)
        done = {}
        while eng.has_unfinished_requests():
            done.update({o.request_id: o for o in eng.step() if o.finished})
            eng.check_invariants()
        assert done["extends"].num_cached_tokens == 32
    with LLM(model=tiny_ckpts["llama"], overrides=[*overrides, "cache.enable=false"]) as ref:
        want = ref.generate([[*prefix, 5]], long, use_tqdm=False)[0].outputs[0].token_ids
    assert done["extends"].outputs[0].token_ids == want
