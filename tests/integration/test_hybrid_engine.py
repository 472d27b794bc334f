"""Hybrid (Gated DeltaNet + attention) models through the engine: parity, state reuse, ledger."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import load_hf_model

from hyloop import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def hf_greedy(hf_model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    ids, first = list(prompt), None
    with torch.no_grad():
        for _ in range(n):
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            first = logits if first is None else first
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :], first


def rand_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_greedy_matches_transformers(hybrid_ckpts, arch: str) -> None:
    prompts = [rand_ids(n, i) for i, n in enumerate([5, 63, 64, 65, 130, 200])]
    hf = load_hf_model(hybrid_ckpts[arch])
    refs = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    overrides = ["graphs.backend=eager", "scheduler.prefill_chunk=64", "kv_pool.num_pages=2048"]
    with LLM(model=hybrid_ckpts[arch], overrides=overrides) as llm:
        llm.engine.capture_logits = True
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        llm.engine.check_invariants()
    for out, (tokens, _), p in zip(outs, refs, prompts, strict=True):
        assert out.outputs[0].token_ids == tokens, f"prompt of {len(p)}"
    # First-token logits, one request at a time (the engine keeps them per request).
    with LLM(model=hybrid_ckpts[arch], overrides=overrides) as llm:
        llm.engine.capture_logits = True
        for i, (p, (_, ref)) in enumerate(zip(prompts, refs, strict=True)):
            llm.engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=1))
            req = llm.engine.request(f"r{i}")
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
            torch.testing.assert_close(req.logits[0], ref, atol=1e-3, rtol=0)


def _run_one(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], int, list[torch.Tensor]]:
    llm.engine.add_request(
        "q", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    )
    req = llm.engine.request("q")
    cached = None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                cached = out.num_cached_tokens
        llm.engine.check_invariants()
    return req.output_ids, cached, req.logits


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_multi_turn_hits_end_snapshot(hybrid_ckpts, arch: str) -> None:
    """page_size 1: turn 2 extends turn 1's prompt + output and hits its end snapshot."""
    turn1 = rand_ids(90, 7)
    results = {}
    for enable in (True, False):
        overrides = [
            "graphs.backend=eager",
            "kv_pool.page_size=1",
            "scheduler.prefill_chunk=64",
            f"cache.enable={enable}",
        ]
        with LLM(model=hybrid_ckpts[arch], overrides=overrides) as llm:
            llm.engine.capture_logits = True
            out1, _, _ = _run_one(llm, turn1, 12)
            turn2 = turn1 + out1 + rand_ids(9, 8)
            results[enable] = _run_one(llm, turn2, 16)
            results[enable] = (*results[enable], len(turn1) + len(out1) - 1)
    (tok_on, cached_on, logits_on, end1), (tok_off, cached_off, logits_off, _) = (
        results[True],
        results[False],
    )
    assert cached_off == 0
    assert cached_on == end1  # turn 1's prompt + output, less its last (unfed) token
    assert tok_on == tok_off
    for a, b in zip(logits_on, logits_off, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_shared_prefix_hits_last_track_boundary(hybrid_ckpts, arch: str) -> None:
    """page_size 16, track_interval 64: a 300-token shared prefix hits at 256."""
    prefix = rand_ids(300, 11)
    first = prefix + rand_ids(20, 12)
    later = [prefix + rand_ids(15 + i, 20 + i) for i in range(3)]
    results = {}
    for enable in (True, False):
        overrides = [
            "graphs.backend=eager",
            "kv_pool.page_size=16",
            "recurrent_pool.track_interval=64",
            "scheduler.prefill_chunk=128",
            f"cache.enable={enable}",
        ]
        with LLM(model=hybrid_ckpts[arch], overrides=overrides) as llm:
            llm.engine.capture_logits = True
            _run_one(llm, first, 4)
            results[enable] = [_run_one(llm, p, 8) for p in later]
    for (tok_on, cached_on, lg_on), (tok_off, cached_off, lg_off) in zip(
        results[True], results[False], strict=True
    ):
        assert cached_on == 256 and cached_off == 0
        assert tok_on == tok_off
        for a, b in zip(lg_on, lg_off, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_randomized_workload_ledger(hybrid_ckpts, page_size: int) -> None:
    """300 requests, shared prefixes, 10% aborted at random steps, a pool too small for all."""
    rng = random.Random(page_size)
    bases = [rand_ids(rng.randint(20, 120), 100 + i) for i in range(6)]
    overrides = [
        "graphs.backend=eager",
        f"kv_pool.page_size={page_size}",
        "kv_pool.num_pages=" + str(1 + 3000 // page_size),
        "recurrent_pool.num_slots=24",
        "recurrent_pool.track_interval=32",
        "scheduler.prefill_chunk=64",
        "scheduler.max_running_requests=8",
    ]
    with LLM(model=hybrid_ckpts["qwen3_5"], overrides=overrides) as llm:
        eng = llm.engine
        to_abort: dict[int, str] = {}
        for i in range(300):
            prompt = rng.choice(bases)[: rng.randint(1, 120)] + rand_ids(rng.randint(1, 40), i)
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.8]), seed=i, max_tokens=rng.randint(1, 24)
            )
            eng.add_request(f"r{i}", prompt, params)
            if rng.random() < 0.1:
                to_abort.setdefault(rng.randint(0, 400), f"r{i}")
        finished, step = {}, 0
        while eng.has_unfinished_requests():
            if step in to_abort:
                eng.abort_request(to_abort[step])
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = out
            eng.check_invariants()
            step += 1
        assert len(finished) == 300
        # Everything is back: free, or owned by the tree.
        free = eng.cache.kv.available_size()
        assert free + eng.cache.tree.total_size() == eng.cache.kv.capacity
        rec = eng.cache.recurrent
        assert rec.available_size() + eng.cache.tree.total_size("recurrent") == rec.capacity
        assert any(o.outputs[0].finish_reason == "abort" for o in finished.values())
