"""Position-independent reuse that changes nothing a user can see, on a 4-layer tiny Llama.

Selective recompute: the layers up to the check layer hold this context's K/V for every token;
past it, the reused tokens it recomputes are exactly those whose check-layer K deviates most
from the donor's (the deviation measured here from a reuse-off run and a plain-shift run) times
the attention the query pays them, and the rest keep the donor's KV bit for bit. Exact and
approximate KV: a prompt that is an exact prefix of an earlier reused one is served exact KV
(equal logits) or counts the rest as reuse, never approximate KV as cached. ``cache_salt``:
tenants with the same documents share no node and no donor, in the engine, through
``LLM.generate`` and through ``run-batch``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_DENSE, build_hf_checkpoint

from hyloop import LLM, SamplingParams
from hyloop.cache import MatchPrefixParams, RadixKey
from hyloop.cli import main
from hyloop.framework.requests import Request
from hyloop.graphs.safety import check_capture_safe
from hyloop.models import blend as blend_model
from hyloop.recipes import run_batch
from hyloop.sampling_params import BeamSearchParams

PI = ["graphs.backend=eager", "cache.position_independent.enable=true"]
SHIFT_ONLY = [*PI, "cache.position_independent.recompute_tokens=0"]
SHIFT_ONLY.append("cache.position_independent.recompute_ratio=0")
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
RATIO = ["cache.position_independent.recompute_ratio=0.25"]
CHECK_2 = "cache.position_independent.check_layer=2"  # of 4 layers: one runs past it
# Short content-defined chunks: every document holds many whole chunks wherever it sits.
SMALL_CHUNKS = [*PI, "cache.position_independent.boundary_bits=4"]
SMALL_CHUNKS.append("cache.position_independent.min_chunk=16")


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("llama4")
    return build_hf_checkpoint(root / "llama4", dict(TINY_DENSE["llama"], num_hidden_layers=4))


def rand(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=g).tolist()


def layer_kv(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[layers, len(ids), Hkv, D]`` the tree holds for ``ids`` (approximate KV too)."""
    key = RadixKey(ids)
    m = llm.engine.cache.tree.match_prefix(MatchPrefixParams(key, full_only=True, approximate=True))
    assert m.prefix_len == len(ids)
    kv = llm.engine.kind.pools.kv
    idx = m.device_indices
    return torch.stack([k[idx] for k in kv.k]), torch.stack([v[idx] for v in kv.v])


def kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    p, q = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    return float((p.exp() * (p - q)).sum())


def test_selective_recompute_recomputes_the_most_deviating_tokens(
    llama4: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(21)
    doc = rand(g, 300)
    donor, query = rand(g, 40) + doc + rand(g, 3), rand(g, 90) + doc + rand(g, 4)
    n = len(query) - 1  # one prefill chunk: the query is shorter than scheduler.prefill_chunk
    seen: list[torch.Tensor] = []  # the attention that weighed each token's deviation

    def observed(*args: Any) -> torch.Tensor:
        seen.append(real_observed(*args))
        return seen[-1]

    real_observed = blend_model.observed
    monkeypatch.setattr(blend_model, "observed", observed)
    runs: dict[str, Any] = {}
    for name, overrides in [
        ("off", ["graphs.backend=eager"]),
        ("shift", SHIFT_ONLY),
        ("blend", [*PI, "cache.position_independent.recompute_tokens=0", *RATIO, CHECK_2]),
    ]:
        with LLM(model=llama4, overrides=overrides) as llm:
            llm.generate([donor], ONE, use_tqdm=False)
            kind, blends = llm.engine.kind, []
            step = kind.step

            def checked(batch: Any, step: Any = step, blends: list[int] = blends) -> Any:
                if batch.blend is None:
                    return step(batch)
                blends.append(batch.blend.keep)  # the selection waits on no host read:
                return check_capture_safe(step, batch)

            kind.step = checked  # type: ignore[method-assign]
            runs[name] = (run(llm, query), *layer_kv(llm, query[:-1]))
            llm.engine.check_invariants()
            assert len(blends) == (name == "blend")
    (_, k_off, v_off), (shift, k_sh, v_sh), (blend, k_bl, v_bl) = (
        runs["off"],
        runs["shift"],
        runs["blend"],
    )
    reused = shift.num_reused
    assert reused > 250 and blend.num_reused == reused and len(shift.reused_spans) == 1
    assert blend.num_recomputed == math.ceil(0.25 * reused)
    # Check layer 2 and the layers before it: this context's K/V for every token.
    torch.testing.assert_close(k_bl[:3], k_off[:3], atol=1e-5, rtol=0)
    torch.testing.assert_close(v_bl[:3], v_off[:3], atol=1e-5, rtol=0)
    # Past it: a reused token was recomputed iff its layer-3 KV left the donor's.
    span = torch.zeros(n, dtype=torch.bool)
    start, end = shift.reused_spans[0]
    span[start:end] = True
    moved = ((k_bl[3] != k_sh[3]).flatten(1).any(1) | (v_bl[3] != v_sh[3]).flatten(1).any(1)) & span
    kept = span & ~moved
    assert int(moved.sum()) == blend.num_recomputed
    # The others keep the donor's KV bit for bit; a recomputed token read only exact KV below.
    assert torch.equal(k_bl[3][kept], k_sh[3][kept])
    assert torch.equal(v_bl[3][kept], v_sh[3][kept])
    torch.testing.assert_close(k_bl[3][moved], k_off[3][moved], atol=1e-5, rtol=0)
    # The recomputed ones are the top of the check layer's K deviation from the donor's, times
    # the attention the query's last tokens pay them there.
    (attention,) = seen
    score = (k_off[2] - k_sh[2]).square().sum((-2, -1)) * attention[0, :n]
    assert float(score[moved].min()) >= float(score[kept].max()) * (1 - 1e-4)
    # Deviation alone would pick otherwise: the weight is what chose.
    dev = (k_off[2] - k_sh[2]).square().sum((-2, -1))
    assert float(dev[moved].min()) < float(dev[kept].max())


def test_a_selective_prompt_prefills_whole_and_waits_rather_than_split(llama4: Path) -> None:
    """A reused prompt longer than the chunk limit still runs in one chunk (its reused tokens
    cost a quarter each, ``RATIO``); one that the rest of a step's budget cannot take whole
    waits for the next step instead of being split: each chunk ends with its query."""
    g = torch.Generator().manual_seed(5)
    docs = [rand(g, 700), rand(g, 300)]
    queries = [rand(g, 30) + docs[0] + rand(g, 20), rand(g, 30) + docs[1] + rand(g, 450)]
    budget = ["scheduler.prefill_chunk=700", "scheduler.prefill_token_budget=800"]
    with LLM(model=llama4, overrides=[*PI, *RATIO, *budget]) as llm:
        llm.generate([rand(g, 20) + d for d in docs], ONE, use_tqdm=False)
        steps: list[list[tuple[int, int, bool]]] = []
        plan = llm.engine.scheduler.next_batch

        def recorded() -> Any:
            batch = plan()
            if batch is not None and not batch.is_decode:
                steps.append([(c.start, c.length, c.completes_prompt) for c in batch.chunks])
            return batch

        llm.engine.scheduler.next_batch = recorded  # type: ignore[method-assign]
        outs = llm.generate(queries, ONE, use_tqdm=False)
        llm.engine.check_invariants()
    assert outs[0].num_reused_tokens >= 600 and outs[1].num_reused_tokens >= 200
    # Both were admitted at once (750 pending tokens < 800), but the first costs ~240 of the
    # 800 and the second ~600: it runs in the next step, whole.
    assert [len(step) for step in steps] == [1, 1]
    (first,), (second,) = steps
    assert first == (0, len(queries[0]), True) and len(queries[0]) > 700
    assert second == (0, len(queries[1]), True)


def test_an_exact_prefix_of_a_reused_prompt_is_exact_or_counted_as_reuse(llama4: Path) -> None:
    g = torch.Generator().manual_seed(8)
    doc = rand(g, 300)
    donor, query = rand(g, 40) + doc + rand(g, 3), rand(g, 90) + doc + rand(g, 6)
    with LLM(model=llama4, overrides=[*PI, CHECK_2]) as llm:
        llm.engine.capture_logits = True
        llm.generate([donor], ONE, use_tqdm=False)
        first = llm.generate([query], ONE, use_tqdm=False)[0]
        assert first.num_reused_tokens > 250 and first.num_cached_tokens == 0
        tree = llm.engine.cache.tree
        exact = tree.match_prefix(MatchPrefixParams(RadixKey(query))).prefix_len
        assert 90 <= exact < 90 + 32  # the reused run and all after it are approximate
        k_tree, _ = layer_kv(llm, query[:-1])
        # An exact prefix that reaches 20 tokens into the approximate KV: too short to plan
        # reuse for, so it computes them (exact KV, nothing reused) ...
        short = query[: exact + 20]
        got = run(llm, short)
        assert (got.num_cached, got.num_reused) == (exact, 0)
        # ... and a longer one: its exact part cached, the rest counted as reuse (and the same
        # selective recompute applies), the tree's approximate KV as a donor at offset 0.
        long = run(llm, query[:-2])
        assert long.num_cached == exact and long.num_reused >= 150 and long.num_recomputed > 0
        llm.engine.check_invariants()
    with LLM(model=llama4, overrides=["graphs.backend=eager"]) as ref:
        ref.engine.capture_logits = True
        want = run(ref, short)
        k_ref, _ = layer_kv(ref, short[:-1])
    assert got.logits and want.logits
    torch.testing.assert_close(got.logits[0], want.logits[0], atol=1e-4, rtol=1e-4)
    # ... where serving the tree's KV as cached would have read other keys.
    assert (k_tree[3, exact : len(short) - 1] - k_ref[3, exact:]).abs().max() > 1e-2


def run(llm: LLM, prompt: list[int]) -> Request:
    """``prompt`` run alone (one token); its request, counters and captured logits kept."""
    engine = llm.engine
    rid = f"r{engine.scheduler.cached_tokens}-{len(prompt)}-{id(prompt)}"
    engine.add_request(rid, prompt, ONE)
    req = engine.request(rid)
    assert req is not None
    while engine.has_unfinished_requests():
        engine.step()
    return req


def namespaces(llm: LLM) -> tuple[set[Any], set[Any]]:
    """The namespaces of the tree's nodes, and those of the donor index's entries, each entry
    checked to lie on a node of its own namespace."""
    tree = llm.engine.cache.tree
    nodes = {ck[0] for ck in tree.root.children}
    reuse = llm.engine.cache.reuse
    donors = set()
    for (ns, _), entries in reuse.index._by_key.items():  # type: ignore[attr-defined]
        for e in entries:
            node = e.anchor
            while node.parent is not tree.root:
                node = node.parent
            assert node.child_key[0] == ns == e.extra_key
            donors.add(ns)
    return nodes, donors


def salted(ids: list[int], salt: str | None) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    return prompt if salt is None else {**prompt, "cache_salt": salt}


def test_tenants_with_other_salts_share_no_node_and_no_donor(llama4: Path) -> None:
    g = torch.Generator().manual_seed(13)
    doc, head, other = rand(g, 300), rand(g, 40), rand(g, 70)
    same, behind = head + doc + rand(g, 4), other + doc + rand(g, 4)
    with LLM(model=llama4, overrides=SMALL_CHUNKS) as llm:
        engine = llm.engine
        outs = {}
        for rid, prompt, salt in [
            ("a1", same, "a"),
            ("b1", same, "b"),  # A's very prompt: no exact hit
            ("n1", behind, None),  # A's and B's document: no donor
            ("a2", same, "a"),  # controls: a tenant hits its own prefix ...
            ("b2", behind, "b"),  # ... and reuses its own document
        ]:
            engine.add_request(rid, salted(prompt, salt), ONE)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    outs[out.request_id] = out
            engine.check_invariants()
        assert (outs["b1"].num_cached_tokens, outs["b1"].num_reused_tokens) == (0, 0)
        assert (outs["n1"].num_cached_tokens, outs["n1"].num_reused_tokens) == (0, 0)
        assert outs["a2"].num_cached_tokens == len(same) - 1
        assert outs["b2"].num_reused_tokens > 200 and outs["b2"].num_cached_tokens == 0
        assert namespaces(llm) == ({"a", "b", None}, {"a", "b", None})
        # LLM.generate: the same prompts, the salt in the prompt dict.
        got = llm.generate([salted(same, "c"), salted(behind, "d")], ONE, use_tqdm=False)
        assert [(o.num_cached_tokens, o.num_reused_tokens) for o in got] == [(0, 0), (0, 0)]
        got = llm.generate([salted(behind, "c")], ONE, use_tqdm=False)[0]
        assert got.num_reused_tokens > 200  # the control: tenant c's own document
        with pytest.raises(ValueError, match="cache_salt: got 7; expected a non-empty string"):
            llm.generate([{"prompt_token_ids": same, "cache_salt": 7}], ONE, use_tqdm=False)
        # Beam search: every beam's request keeps its prompt's salt.
        before = llm.stats()["cached_tokens"]
        llm.beam_search([salted(same, "e")], BeamSearchParams(beam_width=2, max_tokens=2))
        assert "e" in namespaces(llm)[0]
        # the first step hits nothing; the second step's two beams hit the first step's prompt
        assert llm.stats()["cached_tokens"] - before == 2 * len(same)


def test_run_batch_rows_with_other_salts_share_no_node_and_no_donor(
    llama4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(17)
    doc, head, other = rand(g, 300), rand(g, 40), rand(g, 70)
    same, behind = head + doc + rand(g, 4), other + doc + rand(g, 4)
    rows = [("a1", same, "a"), ("b1", same, "b"), ("n1", behind, None)]
    rows += [("a2", same, "a"), ("b2", behind, "b")]
    lines = []
    for cid, prompt, salt in rows:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        lines.append({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body})
    lines.append({**lines[0], "custom_id": "bad", "body": {**lines[0]["body"], "cache_salt": ""}})
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    seen: dict[str, Any] = {}
    success_line = run_batch.success_line

    def keep(row: Any, out: Any, model: str) -> dict[str, Any]:
        seen[row.custom_id] = (out.num_cached_tokens, out.num_reused_tokens)
        return success_line(row, out, model)

    monkeypatch.setattr(run_batch, "success_line", keep)
    argv = ["run-batch", "-i", str(src), "-o", str(dst), "--model", str(llama4), "--no-progress"]
    # One request at a time, so each row finds what the rows before it left in the cache.
    assert main([*argv, *SMALL_CHUNKS, "scheduler.max_running_requests=1"]) == 0
    out = {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert "cache_salt" in out["bad"]["error"]["message"]
    assert seen["b1"] == (0, 0) and seen["n1"] == (0, 0)
    assert seen["a2"][0] == len(same) - 1 and seen["b2"][1] > 200
    usage = out["b1"]["response"]["body"]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    usage = out["a2"]["response"]["body"]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(same) - 1
