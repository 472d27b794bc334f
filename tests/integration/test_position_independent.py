"""Position-independent reuse in the engine: a document served behind another prefix takes its
KV from the donor; layer-0 K after the shift equals K computed at the new positions (layer 0
depends only on token and position) for each RoPE variant; the ledger stays clean."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hyloop import LLM, SamplingParams
from hyloop.api.summary import render_summary
from hyloop.cache import EvictParams, EvictResult, MatchPrefixParams, RadixKey, UnifiedRadixCache
from hyloop.cache.position_independent.reuse import PositionIndependentReuse
from hyloop.framework.config import ConfigError, load_config
from hyloop.models.contract import ModelContract
from hyloop.models.kv_shift import KVShifter, shifter_for
from hyloop.models.layers.rope import RopeSpec
from hyloop.pools import KVPool

PI = [
    "graphs.backend=eager",
    "cache.position_independent.enable=true",
    "cache.position_independent.recompute_tokens=0",
    "cache.position_independent.recompute_ratio=0",  # the shifted KV as it is
]
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

ROPE_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "partial": {"partial_rotary_factor": 0.5},
}


def variant_ckpt(base: Path, root: Path, name: str) -> Path:
    """The tiny Llama with its rope settings replaced (the weights do not depend on them)."""
    path = root / f"llama_rope_{name}"
    if not path.exists():
        shutil.copytree(base, path)
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(ROPE_VARIANTS[name])
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def tree_kv(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer-0 K and V the tree holds for ``ids`` (all of it must be cached, approximate KV
    included)."""
    cache = llm.engine.cache.tree
    key = RadixKey(ids)
    m = cache.match_prefix(MatchPrefixParams(key=key, full_only=True, approximate=True))
    assert m.prefix_len == len(ids)
    kv = llm.engine.kind.pools.kv
    return kv.k[0][m.device_indices].clone(), kv.v[0][m.device_indices].clone()


def rand(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("model", ["default", "linear", "llama3", "partial", "qwen3"])
def test_layer0_k_after_the_shift_equals_k_at_the_new_positions(
    tiny_ckpts, tmp_path_factory, model: str
) -> None:
    if model == "qwen3":  # q/k norm before RoPE, one KV head
        path = tiny_ckpts["qwen3"]
    else:
        path = variant_ckpt(tiny_ckpts["llama"], tmp_path_factory.getbasetemp(), model)
    g = torch.Generator().manual_seed(11)
    doc = rand(g, 300)
    donor = rand(g, 40) + doc + rand(g, 3)
    query = rand(g, 90) + doc + rand(g, 4)
    span = slice(90, 90 + len(doc))
    with LLM(model=path, overrides=PI) as llm:
        llm.generate([donor], ONE, use_tqdm=False)
        k_donor, _ = tree_kv(llm, donor[:-1])
        out = llm.generate([query], ONE, use_tqdm=False)[0]
        llm.engine.check_invariants()
        assert out.num_reused_tokens >= len(doc) - 40 and out.num_cached_tokens == 0
        assert llm.stats()["reused_tokens"] == out.num_reused_tokens
        k_reused, v_reused = tree_kv(llm, query[:-1])
    with LLM(model=path, overrides=["graphs.backend=eager", "cache.enable=true"]) as llm:
        out_ref = llm.generate([query], ONE, use_tqdm=False)[0]
        assert out_ref.num_reused_tokens == 0
        k_ref, v_ref = tree_kv(llm, query[:-1])
    torch.testing.assert_close(k_reused[span], k_ref[span], atol=1e-5, rtol=0)
    torch.testing.assert_close(v_reused[span], v_ref[span], atol=1e-6, rtol=0)
    # the keys did move: the donor computed them 50 positions earlier
    assert (k_donor[40 : 40 + len(doc)] - k_reused[span]).abs().max() > 0.05


def test_row_model_reuses_equal_rows(row_ckpt) -> None:
    """Rows: a document of rows behind other rows is reused (full rows confirmed) and its
    layer-0 K equals the K computed at the new positions."""
    g = torch.Generator().manual_seed(3)

    def rows(n: int) -> list[list[int]]:
        text = torch.randint(3, 64, (n, 1), generator=g)
        return torch.cat([text, torch.randint(0, 32, (n, 3), generator=g)], 1).tolist()

    doc = rows(250)
    donor, query = rows(40) + doc + rows(2), rows(70) + doc + rows(3)
    with LLM(model=row_ckpt, overrides=PI) as llm:
        llm.generate([donor], ONE, use_tqdm=False)
        out = llm.generate([query], ONE, use_tqdm=False)[0]
        llm.engine.check_invariants()
        assert out.num_reused_tokens >= 200
        k_reused, _ = tree_kv(llm, out.prompt_token_ids[:-1])
    with LLM(model=row_ckpt, overrides=["graphs.backend=eager"]) as llm:
        out_ref = llm.generate([query], ONE, use_tqdm=False)[0]
        k_ref, _ = tree_kv(llm, out_ref.prompt_token_ids[:-1])
    span = slice(70, 70 + len(doc))
    torch.testing.assert_close(k_reused[span], k_ref[span], atol=1e-5, rtol=0)


def test_forced_collisions_change_nothing(tiny_ckpts) -> None:
    """Every chunk filed under one fingerprint: each lookup returns every donor, and the token
    check must pick exactly the runs true fingerprints find (zero false matches)."""
    g = torch.Generator().manual_seed(5)
    docs = [rand(g, 500) for _ in range(4)]
    register = [rand(g, 40) + d for d in docs]
    queries = [
        rand(g, 50) + docs[i] + rand(g, 3) + docs[j] + rand(g, 4) for i, j in [(0, 1), (2, 3)]
    ]
    queries.append(rand(g, 600))  # nothing to reuse: every candidate must be refused
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = []
    for force in (False, True):
        with LLM(model=tiny_ckpts["llama"], overrides=PI) as llm:
            index = llm.engine.cache.reuse.index
            index.force_collisions, index.max_donors_per_key = force, 1000
            llm.generate(register, ONE, use_tqdm=False)
            outs = llm.generate(queries, params, use_tqdm=False)
            llm.engine.check_invariants()
            runs.append([(o.num_reused_tokens, o.outputs[0].token_ids) for o in outs])
    assert runs[0] == runs[1]
    assert runs[0][0][0] > 700 and runs[0][1][0] > 700 and runs[0][2][0] == 0


def test_reuse_is_off_by_default_and_refused_where_kv_cannot_move(hybrid_ckpts, tmp_path) -> None:
    assert load_config().cache.position_independent.enable is False
    with pytest.raises(ConfigError, match="position_independent.enable needs the prefix cache"):
        load_config(overrides=["cache.enable=false", "cache.position_independent.enable=true"])
    with pytest.raises(ConfigError, match="min_chunk"):
        load_config(overrides=["cache.position_independent.min_chunk=600"])
    with pytest.raises(ValueError, match="recurrent layers"):
        LLM(model=hybrid_ckpts["qwen3_5"], overrides=PI)
    # Sliding-window attention: refused by the model check and by the cache's components.
    windowed = ModelContract((512, None), 1, 32, 256, 2048, rope=RopeSpec(10000.0, 32))
    with pytest.raises(ValueError, match="sliding-window layers"):
        shifter_for(windowed, "windowed")
    kv = KVPool(1, 8, 1, 1, 32, torch.float32, "cpu")
    swa = UnifiedRadixCache(kv.allocator, components=("full", "swa"), sliding_window=64)
    section = load_config().cache.position_independent
    with pytest.raises(ValueError, match="full-attention KV only"):
        PositionIndependentReuse(swa, kv, KVShifter(RopeSpec(10000.0, 32)), section)


@pytest.mark.parametrize("lookahead", [False, True])
def test_randomized_ledger_with_eviction_and_aborts(tiny_ckpts, lookahead: bool) -> None:
    """RAG-shaped traffic through a pool that must evict; requests aborted at random;
    ``check_invariants`` (the index included) after every step; with and without lookahead
    (admission, and so realisation, while a decode step is in flight)."""
    rng = np.random.default_rng(7)
    g = torch.Generator().manual_seed(7)
    docs = [rand(g, int(n)) for n in rng.integers(100, 300, 6)]
    overrides = [*PI[:2], "kv_pool.page_size=4", "kv_pool.num_pages=400"]
    overrides.append("cache.position_independent.recompute_tokens=8")
    overrides += [f"lookahead.enable={lookahead}", "lookahead.min_batch=1"]
    with LLM(model=tiny_ckpts["llama"], overrides=overrides) as llm:
        engine = llm.engine
        live: list[str] = []
        evicted: list[int] = []
        evict = engine.cache.tree.evict

        def counting_evict(params: EvictParams) -> EvictResult:
            result = evict(params)
            evicted.append(result.num_tokens_evicted)
            return result

        engine.cache.tree.evict = counting_evict  # type: ignore[method-assign]
        for i in range(40):
            if rng.random() < 0.6:
                parts = [docs[j] for j in rng.choice(6, 2, replace=False)]
                prompt = rand(g, int(rng.integers(33, 80))) + parts[0] + parts[1] + rand(g, 5)
                params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 12)))
                engine.add_request(f"r{i}", prompt, params)
                live.append(f"r{i}")
            if live and rng.random() < 0.15:
                engine.abort_request(live.pop(int(rng.integers(len(live)))))
            for out in engine.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
            engine.check_invariants()
        while engine.has_unfinished_requests():
            engine.step()
            engine.check_invariants()
        stats = llm.stats()
        assert stats["reused_tokens"] > 500
        assert stats["requests_aborted"] > 0
        assert sum(evicted) > 1000  # the pool was too small: donors were evicted under reuse
        held = engine.cache.tree.total_size() + engine.cache.kv.available_size()
        assert held == engine.cache.kv.capacity
        assert f"reused tokens {stats['reused_tokens']} " in render_summary(llm)
