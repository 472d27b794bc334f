"""Random engine traffic, checked against each request run alone (``test_random_engine``).

A ``Traffic`` is drawn from a seed and a model family: prompts off a few shared roots (prefix
hits), repeats and continuations of earlier prompts, documents behind different prefixes
(position-independent reuse), and unrelated ones; greedy and seeded sampling, stop ids,
``ignore_eos``. ``drive`` feeds it to an engine over time while a second thread aborts running
requests and re-adds their ids during ``step()``, tries bad requests (each must raise a
``ValueError`` naming it and change nothing), and checks the ledger after every step.
``Reference`` runs any request alone on an engine with the cache and lookahead off; every
completed request must equal it, an aborted one must be its beginning.
"""

from __future__ import annotations

import random
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyloop import LLM, SamplingParams
from hyloop.framework.engine import Engine

MAX_CONTEXT = 320
CHUNK = 16
MAX_PROMPT = 290
MAX_NEW = 24


@dataclass(frozen=True)
class Family:
    name: str
    ckpt: Path
    vocab: int
    channels: tuple[int, ...] | None = None  # row models: each channel's vocabulary
    draw: tuple[int, ...] | None = None  # row models: prompt ids drawn below these (specials)
    window: int | None = None  # sliding-window models
    recurrent: bool = False
    reuse: bool = False  # position-independent reuse supported

    def token(self, rng: random.Random) -> Any:
        if self.channels is None:
            return rng.randrange(3, self.vocab)
        top = self.draw or self.channels
        return tuple([rng.randrange(3, top[0])] + [rng.randrange(c) for c in top[1:]])


@dataclass(frozen=True)
class Item:
    """One request: its prompt (token ids, or rows) and sampling spec."""

    prompt: tuple[Any, ...]
    temperature: float
    seed: int
    max_tokens: int
    ignore_eos: bool
    stop_ids: tuple[int, ...] = ()

    def params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            seed=self.seed,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_ids) or None,
        )

    def engine_prompt(self) -> list[Any]:
        return [list(t) if isinstance(t, tuple) else t for t in self.prompt]


def stable_rng(*parts: object) -> random.Random:
    return random.Random(zlib.crc32("/".join(map(str, parts)).encode()))


def make_items(family: Family, rng: random.Random, n: int, greedy: bool = False) -> list[Item]:
    """``n`` requests sharing roots, repeats, continuations and documents."""

    def tokens(k: int) -> list[Any]:
        return [family.token(rng) for _ in range(k)]

    roots = [tokens(rng.randint(30, 100)) for _ in range(3)]
    docs = [tokens(rng.randint(200, 260)) for _ in range(2)]
    prompts: list[list[Any]] = []
    items = []
    for _ in range(n):
        r = rng.random()
        if r < 0.35:
            root = rng.choice(roots)
            prompt = root[: rng.randint(1, len(root))] + tokens(rng.randint(1, 40))
        elif r < 0.55:
            prompt = tokens(rng.randint(5, 30)) + rng.choice(docs) + tokens(rng.randint(1, 8))
        elif r < 0.7 and prompts:
            prompt = list(rng.choice(prompts))  # a repeat, or a continuation of one
            prompt += tokens(rng.randint(1, 20)) if rng.random() < 0.5 else []
        else:
            prompt = tokens(rng.randint(1, 150))
        prompt = prompt[:MAX_PROMPT]
        prompts.append(prompt)
        sampled = not greedy and rng.random() < 0.3
        stop = (
            (rng.randrange(3, family.vocab),)
            if family.channels is None and rng.random() < 0.2
            else ()
        )
        items.append(
            Item(
                tuple(prompt),
                temperature=rng.uniform(0.6, 1.0) if sampled else 0.0,
                seed=rng.randrange(1 << 30),
                max_tokens=rng.randint(1, MAX_NEW),
                ignore_eos=rng.random() < 0.7,
                stop_ids=stop,
            )
        )
    return items


@dataclass
class Result:
    token_ids: list[int]
    rows: list[list[int]] | None
    finish_reason: str | None
    reused: int = 0


def result_of(out: Any) -> Result:
    o = out.outputs[0]
    return Result(list(o.token_ids), o.rows, o.finish_reason, out.num_reused_tokens)


class Reference:
    """Each request run alone, once per (family, page size): cache and lookahead off."""

    def __init__(self) -> None:
        self._llms: dict[tuple[str, int], LLM] = {}
        self._memo: dict[tuple[str, int, Item], Result] = {}

    def __call__(self, family: Family, page_size: int, item: Item) -> Result:
        key = (family.name, page_size, item)
        if key not in self._memo:
            llm = self._llms.get(key[:2])
            if llm is None:
                ov = [
                    "graphs.backend=eager",
                    f"kv_pool.page_size={page_size}",
                    "kv_pool.num_pages=1024",
                    f"model.max_context={MAX_CONTEXT}",
                    f"scheduler.prefill_chunk={CHUNK}",
                    "cache.enable=false",
                    "lookahead.enable=false",
                ]
                llm = self._llms[key[:2]] = LLM(model=family.ckpt, overrides=ov)
            engine = llm.engine
            engine.add_request("alone", item.engine_prompt(), item.params())
            outs = []
            while engine.has_unfinished_requests():
                outs += [o for o in engine.step() if o.finished]
            self._memo[key] = result_of(outs[-1])
        return self._memo[key]

    def close(self) -> None:
        for llm in self._llms.values():
            llm.close()


# -- bad requests -------------------------------------------------------------------------------
def bad_requests(family: Family, capacity: int) -> list[tuple[str, Any, Any]]:
    """``(kind, prompt, params)`` that ``add_request`` must refuse with a ValueError."""
    ok = SamplingParams(max_tokens=4)
    if family.channels is None:
        good, off = [5, 6, 7], [5, family.vocab]
        kinds = [
            ("empty prompt", [], ok),
            ("token id past the vocab", off, ok),
            ("negative token id", [-1, 5], ok),
            ("float token id", [1.5, 5], ok),
            ("nested prompt", [[5, 6]], ok),
            ("text without a tokenizer", "hello", ok),
            ("prompt past the context", [5] * (MAX_CONTEXT + 4), ok),
        ]
        if capacity < MAX_CONTEXT - 10:  # fits the context, never the KV pool
            kinds.append(
                (
                    "more KV than the pool",
                    [5] * (capacity - 2),
                    SamplingParams(max_tokens=8, ignore_eos=True),
                )
            )
    else:
        row = [5] + [1] * (len(family.channels) - 1)
        good = [row, row]
        kinds = [
            ("empty prompt", [], ok),
            ("row of the wrong width", [row[:-1]], ok),
            ("channel id past its vocab", [[5, family.channels[1]] + row[2:]], ok),
            ("negative channel id", [[5, -1] + row[2:]], ok),
            ("rows past the context", [row] * (MAX_CONTEXT + 4), ok),
        ]
    kinds += [
        ("prompt of None", None, ok),
        ("negative temperature", good, dict(temperature=-1.0)),
        ("top_p above 1", good, dict(top_p=1.5)),
        ("top_k below -1", good, dict(top_k=-5)),
        ("max_tokens 0", good, dict(max_tokens=0)),
        ("params of the wrong type", good, {"max_tokens": 3}),
        ("logprobs past max_logprobs", good, dict(logprobs=10**6)),
        ("n of 0", good, dict(n=0)),
        ("min_p above 1", good, dict(min_p=2.0)),
        ("repetition_penalty 0", good, dict(repetition_penalty=0.0)),
        ("negative min_tokens", good, dict(min_tokens=-1)),
        ("seed of a string", good, dict(seed="x")),
        ("truncate_prompt_tokens -5", good, dict(truncate_prompt_tokens=-5)),
    ]
    return kinds


def try_bad(engine: Engine, rid: str, kind: tuple[str, Any, Any]) -> None:
    """``add_request`` refuses it with a ValueError naming ``rid``; nothing is queued."""
    name, prompt, params = kind
    before = engine.get_num_unfinished_requests()
    try:
        if isinstance(params, dict) and name != "params of the wrong type":
            params = SamplingParams(**params)  # may refuse right here: as good
        engine.add_request(rid, prompt, params)
    except ValueError as e:
        assert rid in str(e) or isinstance(params, dict), (name, str(e))
    else:
        raise AssertionError(f"bad request ({name}) was accepted")
    assert engine.get_num_unfinished_requests() == before, name


# -- driving an engine --------------------------------------------------------------------------
@dataclass
class Run:
    """What ``drive`` saw: each request id's items in the order they were added, and their
    outputs in the order they finished."""

    added: dict[str, list[Item]] = field(default_factory=dict)
    finished: dict[str, list[Result]] = field(default_factory=dict)
    steps: int = 0
    max_waiting: int = 0
    aborts: int = 0
    bad: int = 0


def drive(
    engine: Engine,
    items: list[Item],
    spares: list[Item],
    rng: random.Random,
    bad: list[tuple[str, Any, Any]],
) -> Run:
    """Feed ``items`` over time; a second thread aborts running requests (re-adding the id
    with a spare item half the time) while steps run; ``bad`` requests are tried on the way;
    the ledger is checked after every step."""
    run = Run()
    quiet = threading.Lock()  # held while this thread checks the engine between steps
    live: list[str] = []
    todo = deque(enumerate(items))
    spare = deque(spares)
    actions = max(1, len(items) // 5)
    abort_rng = random.Random(rng.random())
    failure: list[BaseException] = []

    def add(rid: str, item: Item) -> None:
        engine.add_request(rid, item.engine_prompt(), item.params())
        run.added.setdefault(rid, []).append(item)
        live.append(rid)

    def aborter() -> None:
        try:
            for _ in range(actions):
                time.sleep(abort_rng.uniform(0.0, 0.03))
                with quiet:
                    if not live:
                        continue
                    rid = abort_rng.choice(live)
                    engine.abort_request(rid)
                    run.aborts += 1
                    if spare and abort_rng.random() < 0.5:
                        add(rid, spare.popleft())  # the id is free once its abort applies
        except BaseException as e:
            failure.append(e)

    thread = threading.Thread(target=aborter, name="aborter")
    thread.start()
    try:
        while todo or thread.is_alive() or engine.has_unfinished_requests():
            with quiet:
                for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
                    if todo:
                        i, item = todo.popleft()
                        add(f"r{i}", item)
                if bad and rng.random() < 0.05:
                    try_bad(engine, f"bad{run.bad}", rng.choice(bad))
                    run.bad += 1
            outs = engine.step()
            with quiet:
                engine.check_invariants()
                run.steps += 1
                run.max_waiting = max(run.max_waiting, len(engine.scheduler.waiting))
                for out in outs:
                    if out.finished:
                        run.finished.setdefault(out.request_id, []).append(result_of(out))
                        live.remove(out.request_id)
            if not engine.has_unfinished_requests() and not todo:
                time.sleep(0.001)  # idle while the aborter still runs
    finally:
        thread.join()
    if failure:
        raise failure[0]
    return run


def check_run(run: Run, reference: Any, exact_unless_reused: bool) -> int:
    """Every finished request equals its reference (an aborted one: its beginning); returns how
    many completed. ``exact_unless_reused``: a request that reused KV at another offset
    (approximate) need only be well formed."""
    completed = 0
    for rid, items in run.added.items():
        results = run.finished.get(rid, [])
        assert len(results) == len(items), (rid, len(results), len(items))
        for item, got in zip(items, results, strict=True):
            want = reference(item)
            assert len(got.token_ids) <= item.max_tokens, rid
            if got.finish_reason == "abort":
                assert got.token_ids == want.token_ids[: len(got.token_ids)], rid
                continue
            completed += 1
            if exact_unless_reused and got.reused:
                assert got.finish_reason in ("stop", "length"), rid
                assert got.finish_reason != "length" or len(got.token_ids) == item.max_tokens
                continue
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), rid
            assert got.rows == want.rows, rid
    return completed
