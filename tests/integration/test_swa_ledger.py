"""One ledger for the sliding-window pool: the window pages the tree pins under a request's lock
count against that request's reservation, so admission's promise and the pool cannot disagree.

Issue 29's three repros (tiny random Gemma 3, window 20, prefill chunk 16): each used to stop
the engine (a reserved page missing, or a prefix hit refused by an idle engine). They must
queue and finish with the tokens of the cache off, at page sizes 1 and 16, every step within
the ledger: no request holds and pins more than it reserved, the reservations fit the pool.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_gemma3_parity import TINY_GEMMA3, build_gemma3_checkpoint

from hyloop import LLM, SamplingParams

WINDOW = 20
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = dict(TINY_GEMMA3, sliding_window=WINDOW)
    return build_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3_w20") / "tiny", config)


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(
    ckpt: Path, cache: bool, extra: list[str], waves: list[list[tuple[list[int], int]]]
) -> tuple[list[dict[str, list[int]]], int]:
    """Each wave's requests ``(prompt, max_tokens)`` added together and stepped to the end,
    the ledger checked after every step; tokens by request, and the most pages the tree
    pinned for one request."""
    ov = [
        "graphs.backend=eager",
        "scheduler.prefill_chunk=16",
        f"cache.enable={str(cache).lower()}",
        *extra,
    ]
    outs, most_pinned = [], 0
    with LLM(model=ckpt, overrides=ov) as llm:
        engine = llm.engine
        windows = engine.cache.windows
        assert windows is not None
        for w, wave in enumerate(waves):
            refused = 0
            for i, (prompt, new) in enumerate(wave):
                params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
                if len(prompt) + new > engine.cache.kv.capacity:  # never fits: refused now
                    with pytest.raises(ValueError, match="KV tokens but the pool holds"):
                        engine.add_request(f"w{w}-{i}", prompt, params)
                    refused += 1
                    continue
                engine.add_request(f"w{w}-{i}", prompt, params)
            done: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        assert out.outputs[0].finish_reason == "length"
                        done[out.request_id] = out.outputs[0].token_ids
                engine.check_invariants()
                most_pinned = max([most_pinned, *(h.pinned for h in windows._held.values())])
            assert len(done) == len(wave) - refused
            outs.append(done)
    return outs, most_pinned


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_long_prompt_in_the_smallest_window_pool(ckpt: Path, page_size: int) -> None:
    """Repro 1: a 100-token prompt, the window pool at the least assembly accepts (40 pages
    of 1; 8 of 16). The lock pins only the window the next chunk reads, and counts."""
    pages = 40 if page_size == 1 else 8
    extra = [f"kv_pool.page_size={page_size}", f"kv_pool.swa_num_pages={pages}"]
    waves = [[(rand_ids(100, 1), 8)]]
    got, pinned = run(ckpt, True, extra, waves)
    assert pinned > 0  # the tree's window pages were pinned, and counted
    assert got == run(ckpt, False, extra, waves)[0]


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_prefix_hit_is_admitted_against_what_it_pins(ckpt: Path, page_size: int) -> None:
    """Repro 2: the same 100-token prompt again plus 10 tokens, a prefix hit whose window the
    idle engine used to refuse (it pinned 2 pages, then demanded the whole reservation free)."""
    pages = 8 if page_size == 16 else 40
    extra = [f"kv_pool.page_size={page_size}", f"kv_pool.swa_num_pages={pages}"]
    first = rand_ids(100, 1)
    waves = [[(first, 8)], [(first + rand_ids(10, 2), 8)]]
    with LLM(
        model=ckpt, overrides=["graphs.backend=eager", "scheduler.prefill_chunk=16", *extra]
    ) as llm:
        llm.generate([first], PARAMS, use_tqdm=False)
        hit = llm.generate([waves[1][0][0]], PARAMS, use_tqdm=False)[0]
        assert hit.num_cached_tokens >= 64  # it did hit past the window
    got, _ = run(ckpt, True, extra, waves)
    assert got == run(ckpt, False, extra, waves)[0]


@pytest.mark.parametrize(
    ("page_size", "budget_mb", "seed"), [(1, 0.12, 0), (1, 0.12, 1), (1, 0.12, 2), (16, 0.5, 0)]
)
def test_default_sizing_queues_random_prompts(
    ckpt: Path, page_size: int, budget_mb: float, seed: int
) -> None:
    """Repro 3: the default pool sizing from a small memory budget, 30 random prompts of 1-150
    tokens; those the KV pool can never hold are refused at ``add_request``, the cache-off run
    refuses the same, the rest queue and finish. (At page size 16, 0.12 MB leaves a one-page
    full pool beside the window pool's minimum: 0.5 MB there.)"""
    rng = random.Random(seed)
    wave = [(rand_ids(rng.randint(1, 150), 100 * seed + i), rng.randint(1, 16)) for i in range(30)]
    extra = [f"kv_pool.page_size={page_size}", f"kv_pool.memory_budget_mb={budget_mb}"]
    got = run(ckpt, True, extra, [wave])[0]
    assert len(got[0]) >= 15
    assert got == run(ckpt, False, extra, [wave])[0]
