"""Sliding-window layers hold KV for their window only, every step of a long generation.

A tiny Gemma 3 (window 16) generates 2,000 tokens for two requests (page_size 16, lookahead; a
shorter run with page_size 1); after every step each
running request's sliding-window pages stay within window + page_size tokens once it decodes
and window + prefill_chunk while it prefills, the ledger of both pools balances, and the tokens
equal those of the same model with every layer kept in the full pool.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_gemma3_parity import TINY_GEMMA3, build_gemma3_checkpoint

from hyloop import LLM, SamplingParams

WINDOW = 16
CHUNK = 32
NEW_TOKENS = 2000


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = dict(TINY_GEMMA3, sliding_window=WINDOW)
    return build_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3_w16") / "tiny", config)


def overrides(page_size: int, swa_pool: bool, lookahead: bool) -> list[str]:
    return [
        "graphs.backend=eager",
        f"kv_pool.page_size={page_size}",
        "kv_pool.num_pages=4200",
        f"kv_pool.swa_pool={str(swa_pool).lower()}",
        "model.max_context=2048",
        f"scheduler.prefill_chunk={CHUNK}",
        f"scheduler.prefill_token_budget={CHUNK}",
        f"lookahead.enable={str(lookahead).lower()}",
        "lookahead.min_batch=1",
    ]


@pytest.mark.parametrize(
    ("page_size", "lookahead", "new_tokens"), [(16, True, NEW_TOKENS), (1, False, 400)]
)
def test_sliding_kv_stays_within_the_window(
    ckpt: Path, page_size: int, lookahead: bool, new_tokens: int
) -> None:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (45, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    with LLM(model=ckpt, overrides=overrides(page_size, True, lookahead)) as llm:
        engine = llm.engine
        windows = engine.cache.windows
        assert windows is not None
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        reqs = [engine.request(str(i)) for i in range(len(prompts))]
        peak_decode = peak_prefill = steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            for req in engine.scheduler.running:
                held = windows.held_tokens(req.request_id)
                if req.num_computed > len(req.prompt_ids):  # its last step was a decode step
                    assert held <= WINDOW + page_size, (req.request_id, held)
                    peak_decode = max(peak_decode, held)
                else:
                    assert held <= WINDOW + CHUNK, (req.request_id, held)
                    peak_prefill = max(peak_prefill, held)
            engine.check_invariants()
        stats = engine.stats()
        # What is left in the window pool is the windows the tree keeps.
        assert stats["kv_swa_tokens_used"] == engine.cache.tree.total_size("swa") > 0
        assert stats["kv_full_tokens_used"] == engine.cache.tree.total_size("full")
        pooled = [r.output_ids for r in reqs]
    assert steps > new_tokens
    assert peak_decode >= WINDOW  # the window was really held, not skipped
    assert all(len(out) == new_tokens for out in pooled)
    with LLM(model=ckpt, overrides=overrides(page_size, False, False)) as llm:
        full = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.cache.windows is None
    assert pooled == full


def test_reservations_follow_the_requests_own_chunk_and_shrink_when_decoding(ckpt: Path) -> None:
    """A window pool of 83 usable pages (page_size 1, window 16, prefill_chunk 32): a full-chunk
    reservation (16 + 32 + 3 = 51) would run these requests one at a time. A 4-token prompt
    reserves 16 + 4 + 3 = 23 pages while it prefills, so three start together; decoding, each
    needs 16 + 1 + 3 = 20, which leaves room for the fourth while they run. Tokens equal the
    full pool's, and both pools' ledgers balance after every step."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (4,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    tight = [*overrides(1, True, False), "kv_pool.swa_num_pages=84", "cache.enable=false"]
    with LLM(model=ckpt, overrides=tight) as llm:
        engine = llm.engine
        windows = engine.cache.windows
        assert windows is not None and windows.allocator.num_pages == 84
        assert windows.pages_per_request == 51  # the full-chunk worst case: 1 at a time
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        reqs = [engine.request(str(i)) for i in range(len(prompts))]
        running = []
        while engine.has_unfinished_requests():
            engine.step()
            running.append(len(engine.scheduler.running))
            reserved = [w.reserved for w in windows._held.values()]
            assert sum(reserved) <= 83, reserved
            engine.check_invariants()
        pooled = [r.output_ids for r in reqs]
    assert running[0] == 3  # three prefill reservations of 23 fit, a fourth does not
    assert max(running) == 4  # decoding reservations of 20 made room for the fourth
    with LLM(model=ckpt, overrides=overrides(1, False, False)) as llm:
        full = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert pooled == full
