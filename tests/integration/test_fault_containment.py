"""One request's failure never takes the batch down; a broken invariant stops the engine loudly.

A failure is injected into one request's own step work: its admission (a realised
position-independent reuse plan), its part of a step's preparation (window pages, its step-table
row), or the resolve side (its grammar, its stop check). That request ends with finish reason
``error`` and the message in its output; every other request's tokens equal a run without the
fault; the ledger balances after every step, and once all requests end every page is free or
the tree's. A ``LedgerError`` (nobody's fault) instead ends every request with the error,
reported by that step, and the engine refuses new requests. With lookahead on and off.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import hyloop.framework.scheduler as scheduler_module
from hyloop import LLM, SamplingParams
from hyloop.framework.engine import Engine
from hyloop.pools import LedgerError

TARGET = "r2"


def overrides(lookahead: bool, *extra: str) -> list[str]:
    return [
        "graphs.backend=eager",
        "kv_pool.page_size=4",
        "kv_pool.num_pages=256",
        "scheduler.prefill_chunk=16",
        f"lookahead.enable={str(lookahead).lower()}",
        "lookahead.min_batch=1",
        *extra,
    ]


def workload() -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 256, (24,), generator=g).tolist()
    out = []
    for i, n in enumerate((5, 30, 17, 9, 40)):
        prompt = (shared if i % 2 else []) + torch.randint(3, 256, (n,), generator=g).tolist()
        temp = 0.8 if i == 3 else 0.0  # one sampled request: its seed decides
        params = SamplingParams(temperature=temp, seed=i, max_tokens=12, ignore_eos=True)
        out.append((prompt, params))
    return out


def run(engine: Engine, work: list[tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    """Add every request, step to the end checking the ledger each step; outputs by id."""
    for i, (prompt, params) in enumerate(work):
        engine.add_request(f"r{i}", prompt, params)
    done = run_to_end(engine)
    assert set(done) == {f"r{i}" for i in range(len(work))}
    return done


def run_to_end(engine: Engine) -> dict[str, Any]:
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out.outputs[0]
        engine.check_invariants()
    return done


def assert_pools_full(engine: Engine) -> None:
    """Nothing held: every KV page is free or the tree's, no lock outstanding."""
    engine.check_invariants()
    tree, kv = engine.cache.tree, engine.cache.kv
    assert kv.available_size() + tree.total_size("full") == kv.capacity
    assert tree.num_outstanding_locks() == 0
    assert engine.cache.req_to_token.available() == engine.scheduler.max_running


@pytest.fixture(scope="module")
def reference(tiny_ckpts: dict[str, Path]) -> dict[str, list[int]]:
    with LLM(model=tiny_ckpts["llama"], overrides=overrides(False)) as llm:
        return {rid: o.token_ids for rid, o in run(llm.engine, workload()).items()}


def raise_for_target(calls: int) -> Callable[[Any], None]:
    """A check that raises on the ``calls``-th time it sees the target request."""
    seen = 0

    def check(req: Any) -> None:
        nonlocal seen
        if req.request_id == TARGET:
            seen += 1
            if seen == calls:
                raise RuntimeError(f"injected failure for {TARGET}")

    return check


def inject(engine: Engine, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if where == "stop check":  # resolve side, after its 4th token
        check = raise_for_target(4)
        real = scheduler_module.Scheduler._resolve_one

        def resolve_one(self: Any, batch: Any, i: int, *args: Any) -> Any:
            check(batch.chunks[i].req)
            return real(self, batch, i, *args)

        monkeypatch.setattr(scheduler_module.Scheduler, "_resolve_one", resolve_one)
    elif where == "window pages":  # prepare side, its 3rd step
        check = raise_for_target(3)
        real_advance = engine.cache.advance_window

        def advance_window(req: Any, *args: Any) -> None:
            check(req)
            real_advance(req, *args)

        monkeypatch.setattr(engine.cache, "advance_window", advance_window)
    elif where == "step-table row":  # prepare side: its first step
        check = raise_for_target(1)
        real_bind = engine.kind.bind

        def bind(chunk: Any) -> None:
            check(chunk.req)
            real_bind(chunk)

        monkeypatch.setattr(engine.kind, "bind", bind)
    else:  # the grammar advance of the resolve side, after its 2nd token
        check = raise_for_target(2)
        real_advance = engine.kind.advance

        def advance(batch: Any, i: int, token: int) -> None:
            if batch.is_decode or batch.chunks[i].completes_prompt:
                check(batch.chunks[i].req)
            real_advance(batch, i, token)

        monkeypatch.setattr(engine.kind, "advance", advance)


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("where", ["stop check", "window pages", "step-table row", "grammar"])
def test_a_request_whose_step_work_raises_fails_alone(
    tiny_ckpts: dict[str, Path],
    reference: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
    lookahead: bool,
    where: str,
) -> None:
    with LLM(model=tiny_ckpts["llama"], overrides=overrides(lookahead)) as llm:
        engine = llm.engine
        inject(engine, where, monkeypatch)
        done = run(engine, workload())
        failed = done.pop(TARGET)
        assert failed.finish_reason == "error"
        assert failed.error is not None and f"injected failure for {TARGET}" in failed.error
        # What it produced before the failure is the reference's beginning.
        assert failed.token_ids == reference[TARGET][: len(failed.token_ids)]
        assert {rid: o.token_ids for rid, o in done.items()} == {
            rid: t for rid, t in reference.items() if rid != TARGET
        }
        assert all(o.finish_reason == "length" for o in done.values())
        assert engine.stats()["requests_failed"] == 1
        assert_pools_full(engine)
        # The engine still serves, under the failed request's id too.
        monkeypatch.undo()
        engine.add_request(TARGET, *workload()[2])
        again = run_to_end(engine)
        assert again[TARGET].token_ids == reference[TARGET]


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_realised_reuse_plan_that_raises_fails_its_request_alone(
    tiny_ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch, lookahead: bool
) -> None:
    """Admission: the donor's KV is locked and the request's pages allocated when copying it
    raises; all of it goes back (no lock, no page left), the request fails, the rest run."""
    g = torch.Generator().manual_seed(11)
    doc = torch.randint(3, 256, (300,), generator=g).tolist()
    donor = torch.randint(3, 256, (40,), generator=g).tolist() + doc + [7]
    query = torch.randint(3, 256, (90,), generator=g).tolist() + doc + [9, 10]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    others = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (11, 23)]
    pi = overrides(lookahead, "cache.position_independent.enable=true")
    with LLM(model=tiny_ckpts["llama"], overrides=pi) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(others, params, use_tqdm=False)]
        llm.generate([donor], params, use_tqdm=False)
        engine = llm.engine
        reuse = engine.cache.reuse
        assert reuse is not None
        planned: list[Any] = []
        real_plan = reuse.plan

        def plan(req: Any, cached: int) -> Any:
            got = real_plan(req, cached)
            planned.append((req.request_id, got))
            return got

        def realise(plan: Any, slots: torch.Tensor) -> None:
            assert planned[-1][0] == "query" and plan.reused
            raise RuntimeError("injected failure while copying the donor's KV")

        monkeypatch.setattr(reuse, "plan", plan)
        monkeypatch.setattr(reuse, "realise", realise)
        engine.add_request("a", others[0], params)
        engine.add_request("query", query, params)
        engine.add_request("b", others[1], params)
        done: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
            engine.check_invariants()
        assert done["query"].finish_reason == "error" and done["query"].token_ids == []
        assert "injected failure while copying" in (done["query"].error or "")
        assert [done["a"].token_ids, done["b"].token_ids] == expected
        assert_pools_full(engine)


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_broken_ledger_stops_the_engine_and_reports_every_request(
    tiny_ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch, lookahead: bool
) -> None:
    with LLM(model=tiny_ckpts["llama"], overrides=overrides(lookahead)) as llm:
        engine = llm.engine
        calls = 0
        real_advance = engine.cache.advance_window

        def advance_window(req: Any, *args: Any) -> None:
            nonlocal calls
            calls += 1
            if calls == 12:
                raise LedgerError("injected: the books do not balance")
            real_advance(req, *args)

        monkeypatch.setattr(engine.cache, "advance_window", advance_window)
        work = workload()
        for i, (prompt, params) in enumerate(work):
            engine.add_request(f"r{i}", prompt, params)
        done: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
        assert set(done) == {f"r{i}" for i in range(len(work))}  # every one reported
        stopped = [o for o in done.values() if o.finish_reason == "error"]
        assert stopped and all("the books do not balance" in (o.error or "") for o in stopped)
        assert engine.stopped is not None and "LedgerError" in engine.stopped
        assert_pools_full(engine)
        with pytest.raises(RuntimeError, match="engine stopped"):
            engine.add_request("late", [5, 6, 7], SamplingParams(max_tokens=2))


# -- the recipes write a failed request as its row's error ------------------------------------
ROWS = [[5, 6, 7, 8], [90] * 20, [1, 2, 3], [200, 201, 202]]


def fail_stop_check_of(monkeypatch: pytest.MonkeyPatch, request_id: Callable[[str], bool]) -> None:
    real = scheduler_module.Scheduler._resolve_one

    def resolve_one(self: Any, batch: Any, i: int, *args: Any) -> Any:
        req = batch.chunks[i].req
        if request_id(req.request_id) and len(req.output_ids) == 2:
            raise RuntimeError("injected stop-check failure")
        return real(self, batch, i, *args)

    monkeypatch.setattr(scheduler_module.Scheduler, "_resolve_one", resolve_one)


def test_generate_writes_the_failed_request_as_its_rows_error(
    tiny_ckpts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from hyloop.cli import main

    src = tmp_path / "in.jsonl"
    rows = [{"prompt_token_ids": p, "max_tokens": 5, "temperature": 0.0} for p in ROWS]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["generate", "--model", str(tiny_ckpts["llama"]), "--input", str(src)]
    ov = overrides(True)
    assert main([*argv, "--output", str(tmp_path / "ok.jsonl"), "--no-progress", *ov]) == 0
    ok = [json.loads(line) for line in (tmp_path / "ok.jsonl").read_text().splitlines()]
    fail_stop_check_of(monkeypatch, lambda rid: rid.endswith("-2"))  # the third row
    assert main([*argv, "--output", str(tmp_path / "out.jsonl"), "--no-progress", *ov]) == 1
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    # A failed row's record is its input plus ``error`` (``recipes.records``).
    assert got[2] == {**rows[2], "error": f"{src}:3: RuntimeError: injected stop-check failure"}
    assert [r for i, r in enumerate(got) if i != 2] == [r for i, r in enumerate(ok) if i != 2]


def test_run_batch_writes_the_failed_request_as_its_error_line(
    tiny_ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io
    import json

    from hyloop.recipes import run_batch
    from hyloop.recipes.openai_batch import parse_rows

    lines = [
        json.dumps(
            dict(
                custom_id=f"c{i}",
                method="POST",
                url="/v1/completions",
                body=dict(prompt=p, max_tokens=5, temperature=0.0),
            )
        )
        for i, p in enumerate(ROWS)
    ]

    class Bar:
        def update(self, n: int) -> None:
            pass

    def batch(llm: LLM, rows: list[Any]) -> list[dict[str, Any]]:
        fh = io.StringIO()
        writer = run_batch.OrderedWriter(fh, Bar())
        run_batch.run_rows(llm, rows, list(range(len(rows))), writer, "tiny")
        llm.engine.check_invariants()
        return [json.loads(line) for line in fh.getvalue().splitlines()]

    with LLM(model=tiny_ckpts["llama"], overrides=overrides(False)) as llm:
        ok = batch(llm, parse_rows(lines, None))
        rows = parse_rows(lines, None)
        fail_stop_check_of(monkeypatch, lambda rid: rid == rows[1].request_id)
        got = batch(llm, rows)
    assert got[1]["custom_id"] == "c1" and got[1]["response"]["body"] is None
    assert got[1]["response"]["status_code"] == 500
    assert got[1]["error"]["code"] == "internal_error"
    assert got[1]["error"]["message"].startswith("line 2: RuntimeError: injected stop-check")
    assert [o["error"] for i, o in enumerate(got) if i != 1] == [None] * 3

    def choice(line: dict[str, Any]) -> Any:
        c = line["response"]["body"]["choices"][0]
        return c["text"], c["finish_reason"], line["response"]["body"]["usage"]

    assert [choice(o) for i, o in enumerate(got) if i != 1] == [
        choice(o) for i, o in enumerate(ok) if i != 1
    ]
