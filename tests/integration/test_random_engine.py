"""Randomized engine traffic: requests queue, never crash, and equal the same request alone.

Per model family (dense Llama, hybrid Qwen3.5 with Gated DeltaNet, Gemma 3 with sliding-window
layers, a multi-channel row model, MOSS-TTS-Local frames), page size (1, 16) and config (cache
off / on, lookahead off / on, position-independent reuse where the family has it), random traffic
(``random_traffic``) runs through tiny pools that force queueing and eviction, while a second
thread aborts running requests and re-adds their ids during ``step()`` and bad requests are
refused at ``add_request``. The ledger is checked after every step; every completed request
equals the same request run alone, every aborted one its beginning; once the cache is emptied
(``LLM.reset_prefix_cache``) every pool is whole again. One config runs the compiled step.

CI runs one seed of a few requests per case. Longer runs::

    HYLOOP_RANDOM_SEEDS=3 HYLOOP_RANDOM_REQUESTS=60 .venv/bin/python -m pytest \
        tests/integration/test_random_engine.py
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from random_traffic import (
    CHUNK,
    MAX_CONTEXT,
    MAX_NEW,
    MAX_PROMPT,
    Family,
    Reference,
    bad_requests,
    check_run,
    drive,
    make_items,
    stable_rng,
)
from test_gemma3_parity import TINY_GEMMA3, build_gemma3_checkpoint

from hyloop import LLM
from hyloop.framework.engine import Engine

FAMILIES = ("dense", "hybrid", "gemma3", "rows", "tts")
SEEDS = int(os.environ.get("HYLOOP_RANDOM_SEEDS", "1"))
REQUESTS = int(os.environ.get("HYLOOP_RANDOM_REQUESTS", "6"))
WINDOW = 20

# Short content-defined chunks, so documents of a few hundred tokens are found behind others.
REUSE = [f"cache.position_independent.{k}" for k in ("window=16", "boundary_bits=4")]
REUSE += [f"cache.position_independent.{k}" for k in ("min_chunk=16", "max_chunk=64")]
REUSE += ["cache.position_independent.sink_tokens=8"]

CONFIGS = {  # name -> (cache, lookahead, position-independent reuse)
    "cache-off": (False, False, False),
    "cache-off-lookahead": (False, True, False),
    "cache-on": (True, False, False),
    "cache-on-lookahead": (True, True, False),
    "reuse-lookahead": (True, True, True),
}


@pytest.fixture(scope="module")
def families(
    tiny_ckpts: dict[str, Path],
    hybrid_ckpts: dict[str, Path],
    row_ckpt: Path,
    moss_local_ckpts: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Family]:
    gemma = build_gemma3_checkpoint(
        tmp_path_factory.mktemp("gemma3_w20") / "tiny", dict(TINY_GEMMA3, sliding_window=WINDOW)
    )
    return {
        "dense": Family("dense", tiny_ckpts["llama"], 256, reuse=True),
        "hybrid": Family("hybrid", hybrid_ckpts["qwen3_5"], 256, recurrent=True),
        "gemma3": Family("gemma3", gemma, 256, window=WINDOW),
        "rows": Family("rows", row_ckpt, 64, channels=(64, 32, 32, 32), reuse=True),
        # Text ids below its specials (250-252), codes below the pad code (16).
        "tts": Family(
            "tts",
            moss_local_ckpts["nvq3_v16_l1"],
            256,
            channels=(256, 17, 17, 17),
            draw=(250, 16, 16, 16),
            reuse=True,
        ),
    }


@pytest.fixture(scope="module")
def reference() -> Iterator[Reference]:
    ref = Reference()
    yield ref
    ref.close()


def engine_overrides(
    family: Family, page_size: int, config: str, seed: int, backend: str = "eager"
) -> tuple[list[str], int]:
    """The case's engine config (tiny pools, drawn from the seed) and its KV capacity."""
    cache, lookahead, reuse = CONFIGS[config]
    rng = stable_rng("pools", seed, family.name, page_size, config)
    # Tight (queueing, eviction at every admission) or roomy enough for prefix hits.
    least = MAX_PROMPT + MAX_NEW + 16
    capacity = rng.randint(least, rng.choice([2 * least, 5 * least])) // page_size * page_size
    ov = [
        f"graphs.backend={backend}",
        f"kv_pool.page_size={page_size}",
        f"kv_pool.num_pages={capacity // page_size + 1}",
        f"model.max_context={MAX_CONTEXT}",
        f"scheduler.prefill_chunk={CHUNK}",
        f"scheduler.prefill_token_budget={rng.choice([16, 32, 64])}",
        f"scheduler.max_running_requests={rng.randint(2, 5)}",
        f"cache.enable={str(cache).lower()}",
        f"cache.position_independent.enable={str(reuse).lower()}",
        *(REUSE if reuse else []),
        f"lookahead.enable={str(lookahead).lower()}",
        "lookahead.min_batch=1",
    ]
    if family.window is not None:  # the fewest window pages assembly accepts, up to twice that
        least = -(-(family.window + CHUNK) // page_size) + 4
        ov.append(f"kv_pool.swa_num_pages={rng.randint(least, 2 * least)}")
    if family.recurrent:
        ov.append(f"recurrent_pool.num_slots={rng.randint(3, 10)}")
    return ov, capacity


def assert_pools_whole(llm: LLM) -> None:
    """After ``reset_prefix_cache``: every page and slot is free, the tree empty."""
    engine: Engine = llm.engine
    engine.check_invariants()
    cache = engine.cache
    assert cache.tree.num_outstanding_locks() == 0
    assert cache.tree.total_size("full") == 0
    assert cache.kv.available_size() == cache.kv.capacity
    assert cache.req_to_token.available() == engine.scheduler.max_running
    if cache.windows is not None:
        alloc = cache.windows.allocator
        assert alloc.available_size() == alloc.capacity
    if cache.recurrent is not None:
        assert cache.recurrent.available_size() == cache.recurrent.capacity
    if cache.reuse is not None:
        assert len(cache.reuse.index) == 0  # type: ignore[attr-defined]


def run_case(
    families: dict[str, Family],
    reference: Reference,
    name: str,
    page_size: int,
    config: str,
    seed: int,
    backend: str = "eager",
    extra: tuple[str, ...] = (),
) -> tuple[LLM, int]:
    """Run one case; returns the engine (open) and the steps it took."""
    family = families[name]
    ov, capacity = engine_overrides(family, page_size, config, seed, backend)
    ov += extra
    greedy = backend != "eager"  # one sampling mode: one compiled artifact
    items = make_items(family, stable_rng("traffic", seed, name), REQUESTS, greedy)
    spares = make_items(family, stable_rng("spares", seed, name), REQUESTS, greedy)
    rng = stable_rng("drive", seed, name, page_size, config)
    llm = LLM(model=family.ckpt, overrides=ov)
    run = drive(llm.engine, items, spares, rng, bad_requests(family, capacity))
    reuse = CONFIGS[config][2]
    completed = check_run(run, lambda item: reference(family, page_size, item), reuse)
    assert completed > 0 and run.steps > 0
    assert llm.reset_prefix_cache()
    assert_pools_whole(llm)
    return llm, run.steps


CASES = [
    pytest.param(name, ps, config, seed, id=f"{name}-ps{ps}-{config}-seed{seed}")
    for seed in range(SEEDS)
    for name in FAMILIES
    for ps in (1, 16)
    for config in CONFIGS
    if not CONFIGS[config][2] or name in ("dense", "rows", "tts")  # reuse: dense attention only
]


@pytest.mark.parametrize(("name", "page_size", "config", "seed"), CASES)
def test_random_traffic_equals_each_request_alone(
    families: dict[str, Family],
    reference: Reference,
    name: str,
    page_size: int,
    config: str,
    seed: int,
) -> None:
    llm, _ = run_case(families, reference, name, page_size, config, seed)
    llm.close()


SPECULATIVE = (
    "speculative.method=ngram",
    "speculative.prompt_lookup_min=1",
    "speculative.adaptive=false",
)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("config", ["cache-off", "cache-on-lookahead", "reuse-lookahead"])
def test_random_traffic_with_speculation_equals_each_request_alone(
    families: dict[str, Family], reference: Reference, page_size: int, config: str
) -> None:
    """Speculative decoding on (n-gram drafts, verify steps), against each request alone
    without it: the same tokens, the ledger whole after every step."""
    llm, _ = run_case(families, reference, "dense", page_size, config, 0, extra=SPECULATIVE)
    stats = llm.stats()
    llm.close()
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0


def test_reset_prefix_cache_refuses_while_requests_run(tiny_ckpts: dict[str, Path]) -> None:
    from hyloop import SamplingParams

    with LLM(model=tiny_ckpts["llama"], overrides=["graphs.backend=eager"]) as llm:
        llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3), use_tqdm=False)
        tree = llm.engine.cache.tree
        assert tree.total_size("full") > 0
        llm.engine.add_request("running", [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=4))
        llm.engine.step()
        assert llm.reset_prefix_cache() is False and tree.total_size("full") > 0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert llm.reset_prefix_cache() is True
        assert tree.total_size("full") == 0 and llm.stats()["cache_evictable_tokens"] == 0
        # A repeat now misses, and equals its first run.
        out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3), use_tqdm=False)[0]
        assert out.num_cached_tokens == 0


@pytest.mark.slow
def test_random_traffic_through_the_compiled_step(
    families: dict[str, Family], reference: Reference
) -> None:
    """One case with ``graphs.backend=compile`` (greedy traffic, one batch bucket and one
    context bucket: one artifact), replays counted, none recompiled."""
    extra = ("graphs.buckets=[4]",)
    llm, steps = run_case(
        families, reference, "dense", 16, "cache-on-lookahead", 0, "compile", extra
    )
    stats = llm.stats()
    llm.close()
    assert stats["graph_replays"] > 0 and stats["recompiles"] == 0
    assert stats["graph_replays"] + stats["uncaptured_steps"] <= steps
