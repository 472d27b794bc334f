"""A new per-request feature is one class and one ``register`` line.

``ForbidAfter`` is defined here and nowhere in hyloop: a request's ``extra_args`` may name a
token it must not produce from some output position on. Registered with one line, it runs in
the eager step, in the compiled step and under lookahead, with no other edit: the banned token
never appears from that position on, while the same requests without it produce it there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_DENSE, build_hf_checkpoint

from hyloop import LLM, SamplingParams
from hyloop.features import Feature, RequestContext, register
from hyloop.graphs.capture import ArtifactKey
from hyloop.graphs.request_table import column
from hyloop.graphs.step_batch import StepBatch

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 3, 12, 9, 9], [7, 7, 7, 8], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW = 12
FROM = 3  # the output position the ban starts at


def _spec(req: Any) -> tuple[int, int] | tuple[None, None]:
    return req.features.get(ForbidAfter.name) or (None, None)


class ForbidAfter(Feature):
    """``extra_args={"forbid_after": (token, position)}``: ``token`` is never sampled at an
    output position >= ``position``."""

    name = "forbid_after"
    columns = {
        "forbid_token": column(torch.int64, -1, lambda r: _spec(r)[0]),
        "forbid_from": column(torch.int64, 0, lambda r: _spec(r)[1]),
    }

    @classmethod
    def validate(cls, p: SamplingParams, where: str) -> None:
        spec = (p.extra_args or {}).get(cls.name)
        if spec is not None and (len(spec) != 2 or not all(isinstance(v, int) for v in spec)):
            raise ValueError(f"{where}.extra_args.{cls.name}: got {spec!r}; expected (id, pos)")

    def attach(self, req: Any, ctx: RequestContext, where: str) -> Any:
        spec = (req.params.extra_args or {}).get(self.name)
        return None if spec is None else tuple(spec)

    def apply(self, logits: torch.Tensor, table: Any, batch: StepBatch) -> torch.Tensor:
        rows = batch.req_rows
        token, start = table.forbid_token[rows], table.forbid_from[rows]
        ids = torch.arange(logits.shape[-1], device=logits.device)
        banned = (ids[None, :] == token[:, None]) & (batch.out_pos >= start)[:, None]
        return logits.masked_fill(banned, -torch.inf)  # token -1 (a neutral row) bans nothing


register(ForbidAfter)  # the one line


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_checkpoint(tmp_path_factory.mktemp("plugin") / "llama", TINY_DENSE["llama"])


@pytest.fixture(scope="module")
def eager(ckpt: Path) -> Iterator[LLM]:
    with LLM(model=ckpt, overrides=["graphs.backend=eager", "model.max_context=128"]) as llm:
        yield llm


@pytest.fixture(scope="module")
def compiled(ckpt: Path) -> Iterator[LLM]:
    overrides = [
        "graphs.backend=compile",
        "graphs.buckets=[4]",
        "lookahead.enable=false",
        "lookahead.min_batch=1",
        "model.max_context=128",
    ]
    with LLM(model=ckpt, overrides=overrides) as llm:
        yield llm


def run(llm: LLM, bans: list[int | None]) -> list[list[int]]:
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=NEW,
            ignore_eos=True,
            extra_args=None if ban is None else {"forbid_after": (ban, FROM)},
        )
        for ban in bans
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain(eager: LLM) -> list[list[int]]:
    return run(eager, [None] * len(PROMPTS))


def bans_for(plain: list[list[int]]) -> list[int | None]:
    """Each of the first two prompts bans a token its plain output has from ``FROM`` on; the
    third bans nothing (a neutral row beside them)."""
    return [plain[0][FROM:][0], plain[1][FROM:][-1], None]


def check_banned(plain: list[list[int]], got: list[list[int]]) -> None:
    bans = bans_for(plain)
    for ban, before, ids in zip(bans, plain, got, strict=True):
        if ban is None:
            assert ids == before  # a row without the feature is untouched
            continue
        assert ban in before[FROM:]  # without the feature the token appears there
        assert ban not in ids[FROM:]
        assert ids[:FROM] == before[:FROM]  # before the position, nothing changes


def test_the_feature_acts_in_the_eager_step(eager: LLM, plain: list[list[int]]) -> None:
    check_banned(plain, run(eager, bans_for(plain)))


@pytest.mark.parametrize("lookahead", [False, True])
def test_compiled_and_lookahead_equal_eager(
    eager: LLM, compiled: LLM, plain: list[list[int]], lookahead: bool
) -> None:
    want = run(eager, bans_for(plain))
    engine = compiled.llm_engine
    engine.set_lookahead(lookahead)
    hidden = compiled.stats().get("lookahead_hidden_host_s", 0.0)
    try:
        assert run(compiled, bans_for(plain)) == want
        assert run(compiled, [None] * len(PROMPTS)) == plain
    finally:
        engine.set_lookahead(False)
    stats = compiled.stats()
    assert stats["graph_replays"] > 0
    assert stats["eager_fallbacks"] == 0 and stats["recompiles"] == 0
    assert (stats.get("lookahead_hidden_host_s", 0.0) > hidden) == lookahead
    # its bit is part of the artifact key, named by the feature's name
    keys = [ArtifactKey(*k) for k in engine.graphs.runner.stats()["captured"]]
    assert any(k.features & ForbidAfter.bit for k in keys)
    assert any(ForbidAfter.name in k.label() for k in keys)
