"""Bad input fails alone with an error naming it; abort, stop ids, ignore_eos and max_tokens.

Every bad request is tried on an engine with other requests in flight: those requests must still
finish with the tokens they produce without the bad one, and the pool/tree ledger must balance.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from hyloop import LLM, SamplingParams
from hyloop.framework.config import ConfigError

MAX_CONTEXT = 64
OVERRIDES = [
    "graphs.backend=eager",
    "kv_pool.page_size=4",
    "kv_pool.num_pages=64",
    f"model.max_context={MAX_CONTEXT}",
    "scheduler.prefill_chunk=8",
]
GOOD = {
    "A": ([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
    "B": ([40] * 13, SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)),
}


@pytest.fixture(scope="module")
def llm(tiny_ckpts: dict[str, Path]) -> Iterator[LLM]:
    with LLM(model=tiny_ckpts["llama"], overrides=OVERRIDES) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm: LLM) -> dict[str, list[int]]:
    outs = llm.generate([p for p, _ in GOOD.values()], [s for _, s in GOOD.values()], False)
    return {rid: o.outputs[0].token_ids for rid, o in zip(GOOD, outs, strict=True)}


def drain(llm: LLM) -> dict[str, Any]:
    """Step until idle, checking the ledger after every step; finished outputs by id."""
    done: dict[str, Any] = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                assert out.request_id not in done, f"{out.request_id} finished twice"
                done[out.request_id] = out
        llm.engine.check_invariants()
    return done


# -- config and checkpoint -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("kv_pool.pagesize=4", ["kv_pool.pagesize", "unknown"]),
        ("kv_pool.page_size=abc", ["kv_pool.page_size", "abc"]),
        ("kv_pool.page_size=0", ["kv_pool.page_size", "0"]),
        ("scheduler.max_running_requests=-3", ["scheduler.max_running_requests", "-3"]),
        ("graphs.backend=turbo", ["graphs.backend", "turbo"]),
        ("dtype=float8", ["dtype", "float8"]),
        ("kv_pool.page_size", ["kv_pool.page_size", "key=value"]),
    ],
)
def test_bad_config_names_the_key(tiny_ckpts: dict[str, Path], override: str, named: list[str]):
    with pytest.raises(ConfigError) as info:
        LLM(model=tiny_ckpts["llama"], overrides=[override])
    for part in named:
        assert part in str(info.value)


def test_bad_yaml_config_names_the_key(tiny_ckpts: dict[str, Path], tmp_path: Path) -> None:
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("kv_pool:\n  page_size: 4\nscheduler:\n  max_runing_requests: 8\n")
    with pytest.raises(ConfigError, match=r"scheduler\.max_runing_requests"):
        LLM(model=tiny_ckpts["llama"], config=cfg)
    with pytest.raises(ConfigError, match="missing.yaml"):
        LLM(model=tiny_ckpts["llama"], config=tmp_path / "missing.yaml")


def test_missing_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(model=path)


@pytest.fixture
def ckpt_copy(tiny_ckpts: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_ckpts["llama"], tmp_path / "llama"))


def test_unknown_architecture(ckpt_copy: Path) -> None:
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FooForCausalLM"):
        LLM(model=ckpt_copy)


def _rewrite_weights(ckpt: Path, edit: Any) -> None:
    f = ckpt / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "name", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"]
)
def test_missing_tensor_is_named(ckpt_copy: Path, name: str) -> None:
    _rewrite_weights(ckpt_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError, match="missing") as info:
        LLM(model=ckpt_copy)
    assert name.rsplit(".", 2)[0] in str(info.value)  # the module (fused names may differ)


def test_misshaped_tensor_names_both_shapes(ckpt_copy: Path) -> None:
    name = "model.layers.0.mlp.down_proj.weight"

    def shrink(t: dict[str, Any]) -> None:
        t[name] = t[name][:, :-1].contiguous()

    _rewrite_weights(ckpt_copy, shrink)
    with pytest.raises(ValueError) as info:
        LLM(model=ckpt_copy)
    msg = str(info.value)
    assert name in msg and "(64, 127)" in msg and "(64, 128)" in msg


def test_unexpected_tensor_is_named(ckpt_copy: Path) -> None:
    def add(t: dict[str, Any]) -> None:
        t["model.layers.0.mystery.weight"] = t["model.norm.weight"].clone()

    _rewrite_weights(ckpt_copy, add)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mystery\.weight"):
        LLM(model=ckpt_copy)


# -- bad requests beside good ones ---------------------------------------------------------------
BAD_REQUESTS = [
    ([3, 256, 4], SamplingParams(), ["256", "vocab"]),
    ([3, -1, 4], SamplingParams(), ["-1", "vocab"]),
    ([], SamplingParams(), ["empty"]),
    ("hello", SamplingParams(), ["tokenizer"]),
    (42, SamplingParams(), ["prompt", "int"]),
    ([3, 4.5], SamplingParams(), ["token ids"]),
    ([7] * MAX_CONTEXT, SamplingParams(), [str(MAX_CONTEXT), "max_context"]),
    ([3, 4], SamplingParams(max_tokens=0), ["max_tokens", "0"]),
    ([3, 4], SamplingParams(temperature=-1.0), ["temperature", "-1.0"]),
    ([3, 4], SamplingParams(top_p=0.0), ["top_p", "0.0"]),
    ([3, 4], SamplingParams(top_k=-2), ["top_k", "-2"]),
    ([3, 4], SamplingParams(logprobs=-2), ["logprobs", "-2"]),
    ([3, 4], SamplingParams(stop_token_ids=["x"]), ["stop_token_ids"]),  # type: ignore[list-item]
]


@pytest.mark.parametrize(("prompt", "params", "named"), BAD_REQUESTS)
def test_bad_request_fails_alone(
    llm: LLM, reference: dict[str, list[int]], prompt: Any, params: SamplingParams, named: list[str]
) -> None:
    eng = llm.engine
    for rid, (p, sp) in GOOD.items():
        eng.add_request(rid, p, sp)
    eng.step()
    eng.step()
    with pytest.raises(ValueError) as info:
        eng.add_request("bad-one", prompt, params)
    msg = str(info.value)
    assert "bad-one" in msg
    for part in named:
        assert part in msg
    eng.check_invariants()
    done = drain(llm)
    assert set(done) == set(GOOD)
    for rid in GOOD:
        assert done[rid].outputs[0].token_ids == reference[rid], rid


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("top_p", "0.5"),
        ("max_tokens", 2.5),
        ("top_k", 1.5),
    ],
)
def test_wrongly_typed_sampling_field_is_a_value_error(llm: LLM, field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request("typed", [3, 4], SamplingParams(**{field: value}))
    assert not llm.engine.has_unfinished_requests()


def test_id_in_use_leaves_the_first_request_alone(
    llm: LLM, reference: dict[str, list[int]]
) -> None:
    prompt, sp = GOOD["A"]
    llm.engine.add_request("A", prompt, sp)
    llm.engine.step()
    with pytest.raises(ValueError, match="'A'.*in use"):
        llm.engine.add_request("A", [9, 9], SamplingParams())
    assert drain(llm)["A"].outputs[0].token_ids == reference["A"]


def test_generate_with_one_bad_prompt_leaves_no_trace(
    llm: LLM, reference: dict[str, list[int]]
) -> None:
    free = llm.stats()["kv_free_tokens"] + llm.stats()["cache_evictable_tokens"]
    with pytest.raises(ValueError, match="vocab"):
        llm.generate([GOOD["A"][0], [1, 9999]], GOOD["A"][1], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()
    assert llm.stats()["kv_free_tokens"] + llm.stats()["cache_evictable_tokens"] == free
    out = llm.generate([GOOD["A"][0]], GOOD["A"][1], use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference["A"]


# -- abort ---------------------------------------------------------------------------------------
def test_abort_unknown_or_finished_is_a_noop(llm: LLM) -> None:
    llm.engine.abort_request("never-added")
    llm.engine.add_request("short", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=1))
    done = drain(llm)
    assert done["short"].outputs[0].finish_reason == "length"
    llm.engine.abort_request("short")
    assert llm.engine.step() == []
    llm.engine.check_invariants()


@pytest.mark.parametrize("steps_before", [0, 1, 3, 8])  # waiting, mid-prefill, decoding
def test_abort_frees_the_request(
    llm: LLM, reference: dict[str, list[int]], steps_before: int
) -> None:
    eng = llm.engine
    victim = [60 + i + steps_before for i in range(30)]  # 4 prefill chunks of 8
    eng.add_request("victim", victim, SamplingParams(temperature=0.0, max_tokens=30))
    eng.add_request("A", *GOOD["A"])
    for _ in range(steps_before):
        eng.step()
    reclaimable = llm.stats()["kv_free_tokens"] + llm.stats()["cache_evictable_tokens"]
    eng.abort_request("victim")
    outs = eng.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "victim"] == ["abort"]
    if steps_before:
        # Its reserved pages (prompt + 30 new tokens) are back: free, or unlocked in the tree.
        after = llm.stats()["kv_free_tokens"] + llm.stats()["cache_evictable_tokens"]
        assert after >= reclaimable + 30
    eng.check_invariants()
    done = drain(llm)
    assert "victim" not in done  # its one output was returned above
    assert done["A"].outputs[0].token_ids == reference["A"]
    # Idle: every page is free or held, unlocked, by the tree.
    stats = llm.stats()
    assert stats["kv_free_tokens"] + stats["cache_evictable_tokens"] == stats["kv_capacity_tokens"]


# -- stopping ------------------------------------------------------------------------------------
def test_stop_token_ids_end_on_the_stop_token(llm: LLM, reference: dict[str, list[int]]) -> None:
    prompt, sp = GOOD["B"]
    ref = reference["B"]
    i = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    stop = SamplingParams(**{**vars(sp), "stop_token_ids": [ref[i]]})
    out = llm.generate([prompt], stop, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: i + 1]
    assert out.finish_reason == "stop"


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    eos = 2
    params = [
        SamplingParams(temperature=1.5, seed=s, max_tokens=24, ignore_eos=True) for s in range(16)
    ]
    outs = llm.generate([[17, 18, 19]] * len(params), params, use_tqdm=False)
    samples = [o.outputs[0] for o in outs]
    hits = [
        (p, o.token_ids) for p, o in zip(params, samples, strict=True) if eos in o.token_ids[:-1]
    ]
    assert hits, "no sampled eos among the seeds; pick more seeds"
    sp, ignored = hits[0]
    assert len(ignored) == 24  # ran past eos to max_tokens
    stopped = llm.generate(
        [[17, 18, 19]], SamplingParams(**{**vars(sp), "ignore_eos": False}), False
    )
    cut = ignored.index(eos) + 1
    assert stopped[0].outputs[0].token_ids == ignored[:cut]
    assert stopped[0].outputs[0].finish_reason == "stop"


def test_max_tokens_and_the_context_limit(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    long_prompt = [30] * (MAX_CONTEXT - 3)
    outs = llm.generate([[3, 4, 5], long_prompt], sp, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == [5, 3]  # the second is clipped by the context
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
