"""Prefix reuse through the (FULL, SWA) radix cache on a tiny Gemma 3 (window 8).

The tree keeps the window before every prefill-chunk boundary of an inserted prompt and before
its end; a hit is valid only where the window before it is present. Outputs must equal those of
the same engine with the cache off, hits must happen past the window, a hit whose window was
evicted must be shortened, and a randomized run (shared prefixes, aborts, a window pool small
enough to force SWA eviction) must balance both pools' ledgers after every step.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_gemma3_parity import TINY_GEMMA3, WINDOW, build_gemma3_checkpoint

from hyloop import LLM, SamplingParams
from hyloop.cache import EvictParams, EvictResult, MatchPrefixParams, RadixKey

CHUNK = 32
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3_cache") / "tiny")


def overrides(page_size: int, cache: bool, *extra: str) -> list[str]:
    return [
        "graphs.backend=eager",
        f"kv_pool.page_size={page_size}",
        "kv_pool.num_pages=2048",
        f"cache.enable={str(cache).lower()}",
        f"scheduler.prefill_chunk={CHUNK}",
        f"scheduler.prefill_token_budget={CHUNK}",
        *extra,
    ]


def run(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    llm.engine.check_invariants()
    return out.outputs[0].token_ids, out.num_cached_tokens


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_longer_than_the_window_hits_and_matches_cache_off(
    ckpt: Path, page_size: int
) -> None:
    prefix = rand_ids(90, 1)
    prompts = [prefix + rand_ids(20, 2), prefix + rand_ids(25, 3), prefix[:70] + rand_ids(9, 4)]
    with LLM(model=ckpt, overrides=overrides(page_size, cache=False)) as llm:
        expected = [run(llm, p)[0] for p in prompts]
    with LLM(model=ckpt, overrides=overrides(page_size, cache=True)) as llm:
        got = [run(llm, p) for p in prompts]
        assert llm.engine.cache.tree.total_size("swa") > 0
    assert [tokens for tokens, _ in got] == expected
    # The second prompt shares 90 tokens: at least the chunk boundaries' windows (64) hit.
    assert got[1][1] >= 2 * CHUNK > WINDOW
    # The third shares 70 tokens, beyond the 64-token boundary.
    assert got[2][1] >= 2 * CHUNK


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_hit_whose_window_is_gone_is_shortened(ckpt: Path, page_size: int) -> None:
    prefix = rand_ids(96, 5)
    first, second = prefix + rand_ids(17, 6), prefix + rand_ids(21, 7)
    third = prefix + rand_ids(30, 8)
    with LLM(model=ckpt, overrides=overrides(page_size, cache=False)) as llm:
        expected = run(llm, third)[0]
    with LLM(model=ckpt, overrides=overrides(page_size, cache=True)) as llm:
        run(llm, first)
        run(llm, second)  # the shared prefix is now internal in the tree
        cache = llm.engine.cache.tree
        key = RadixKey(third[:-1])
        before = cache.peek_prefix_len(key)
        assert before >= 2 * CHUNK
        full_before = cache.total_size("full")
        evicted: EvictResult = cache.evict(EvictParams(swa_num_tokens=10**6))
        assert evicted.swa_num_tokens_evicted > 0
        llm.engine.check_invariants()
        m = cache.match_prefix(MatchPrefixParams(key=key))
        # FULL still holds the shared prefix; without its window the hit is cut short.
        assert cache.total_size("full") > 0 and cache.total_size("full") < full_before
        assert m.full_prefix_len >= before > m.prefix_len
        tokens, cached = run(llm, third)
    assert cached < before
    assert tokens == expected


@pytest.mark.parametrize(("page_size", "swa_pages", "lookahead"), [(1, 100, False), (16, 14, True)])
def test_randomized_ledger_with_aborts_and_swa_eviction(
    ckpt: Path, page_size: int, swa_pages: int, lookahead: bool
) -> None:
    rng = random.Random(page_size)
    roots = [rand_ids(60, 10 + i) for i in range(3)]
    extra = [
        # About two requests' windows: the tree must give windows back.
        f"kv_pool.swa_num_pages={swa_pages}",
        "scheduler.max_running_requests=3",
        f"lookahead.enable={str(lookahead).lower()}",
        "lookahead.min_batch=1",
    ]
    with LLM(model=ckpt, overrides=overrides(page_size, True, *extra)) as llm:
        engine = llm.engine
        cache = engine.cache.tree
        swa_evictions: list[int] = []
        evict = cache.evict

        def counting_evict(params: EvictParams) -> EvictResult:
            result = evict(params)
            swa_evictions.append(result.swa_num_tokens_evicted)
            return result

        cache.evict = counting_evict  # type: ignore[method-assign]
        live: list[str] = []
        for i in range(24):
            root = rng.choice(roots)
            prompt = root[: rng.randint(10, 60)] + rand_ids(rng.randint(1, 30), 100 + i)
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 20), ignore_eos=True)
            engine.add_request(f"r{i}", prompt, params)
            live.append(f"r{i}")
            for _ in range(rng.randint(0, 6)):
                if rng.random() < 0.15 and live:
                    engine.abort_request(live.pop(rng.randrange(len(live))))
                engine.step()
                engine.check_invariants()
        while engine.has_unfinished_requests():
            engine.step()
            engine.check_invariants()
        engine.check_invariants()
        assert sum(swa_evictions) > 0, "the small window pool never forced a SWA eviction"
        # Every page is free or the tree's, in both pools.
        kv = engine.cache.kv
        assert kv.available_size() + cache.total_size("full") == kv.capacity
        swa = engine.cache.windows
        assert swa is not None
        alloc = swa.allocator
        assert alloc.available_size() + cache.total_size("swa") == alloc.capacity
        assert cache.num_outstanding_locks() == 0


@pytest.mark.parametrize("page_size", [16])
def test_sharing_900_of_a_1100_token_prompt_hits_at_least_the_chunk_boundary(
    tmp_path_factory: pytest.TempPathFactory, page_size: int
) -> None:
    """Gemma 3's own window (512) with the default prefill_chunk (512)."""
    config = dict(TINY_GEMMA3, sliding_window=512)
    path = build_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3_w512") / "tiny", config)
    first = rand_ids(1100, 20)
    second = first[:900] + rand_ids(40, 21)
    base = ["graphs.backend=eager", f"kv_pool.page_size={page_size}", "kv_pool.num_pages=4096"]
    with LLM(model=path, overrides=[*base, "cache.enable=false"]) as llm:
        expected = run(llm, second)[0]
    with LLM(model=path, overrides=base) as llm:
        run(llm, first)
        tokens, cached = run(llm, second)
    assert cached >= 512
    assert tokens == expected


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_equals_eager_with_the_window_pool_and_cache(ckpt: Path, page_size: int) -> None:
    """On CUDA the captured step (the window mask and the full->window slot translation are
    tensor ops) gives eager's tokens, with and without lookahead, on a second pass that hits
    the cache."""
    prefix = rand_ids(70, 30)
    prompts = [rand_ids(n, 31 + n) for n in (1, 9, 17, 40)] + [prefix + [5, 6], prefix + [9] * 9]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    runs = []
    for backend, lookahead in (("eager", False), ("cuda_graph", False), ("cuda_graph", True)):
        extra = [
            "device=cuda",
            "graphs.buckets=[1,4,8]",
            f"lookahead.enable={str(lookahead).lower()}",
            "lookahead.min_batch=1",
        ]
        ov = [o for o in overrides(page_size, True, *extra) if not o.startswith("graphs.backend")]
        with LLM(model=ckpt, overrides=[*ov, f"graphs.backend={backend}"]) as llm:
            first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            llm.engine.check_invariants()
            stats = llm.engine.stats()
        assert first == second and stats["cached_tokens"] > 0
        assert backend == "eager" or stats["graph_replays"] > 0
        runs.append(first)
    assert runs[1] == runs[0] and runs[2] == runs[0]
