"""The public entry point: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from hyloop.framework.assembly import build_engine
from hyloop.framework.config import EngineConfig, load_config
from hyloop.framework.engine import Engine
from hyloop.framework.requests import RequestOutput
from hyloop.framework.sampling_params import SamplingParams
from hyloop.graphs.capture import Graphs


class LLM:
    """Offline generation over one engine.

    ``model``: an HF checkpoint directory or a ``.gguf`` file; ``config``: YAML file(s) or an
    ``EngineConfig``; ``overrides``: dotlist overrides such as ``["kv_pool.page_size=16"]``.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        config: str | Path | list[str | Path] | EngineConfig | None = None,
        overrides: list[str] | None = None,
    ) -> None:
        if isinstance(config, EngineConfig):
            cfg = config
            if overrides:
                cfg = load_config(None, overrides, base=config.model_dump())
        else:
            cfg = load_config(config, overrides)
        if model is not None:
            cfg = cfg.model_copy(
                update={"model": cfg.model.model_copy(update={"path": str(model)})}
            )
        self.config = cfg
        self.engine = build_engine(cfg)
        self._counter = 0
        self._finalizer = weakref.finalize(self, _close_engine, self.engine)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def graphs(self) -> Graphs:
        """What the engine captures and when: buckets, artifacts, warm-up, the run's report."""
        return self.engine.graphs

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts"
                )
            params = list(sampling_params)
        else:
            params = [sampling_params or self.engine.default_params()] * len(prompts)
        # Only finished outputs are returned: no per-step output copies while running.
        final = {
            id(p): dataclasses.replace(p, output_kind="final_only")
            for p in params
            if isinstance(p, SamplingParams)
        }
        params = [final.get(id(p), p) for p in params]
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                rid = f"gen-{self._counter}"
                self._counter += 1
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            self.engine.step()  # drain the abort outputs
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat() needs a tokenizer; this checkpoint has none")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [tok.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(texts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="requests", disable=not use_tqdm, dynamic_ncols=True)
        s0 = dict(self.engine.stats())
        t0 = time.perf_counter()
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
                s = self.engine.stats()
                bar.set_postfix(_rates(s0, s), refresh=False)
        finally:
            bar.close()
        self.last_run_seconds = time.perf_counter() - t0
        return [done[i] for i in ids]

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def summary(self) -> str:
        from hyloop.framework.summary import render_summary

        return render_summary(self)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rates(s0: dict[str, Any], s: dict[str, Any]) -> dict[str, str]:
    pt = s["prefill_time"] - s0["prefill_time"]
    dt = s["decode_time"] - s0["decode_time"]
    prefill = (s["prefill_tokens_computed"] - s0["prefill_tokens_computed"]) / pt if pt else 0.0
    decode = (s["decode_tokens"] - s0["decode_tokens"]) / dt if dt else 0.0
    return {"prefill tok/s": f"{prefill:.0f}", "decode tok/s": f"{decode:.1f}"}


def _close_engine(engine: Engine) -> None:
    engine.close()
    kv = engine.kind.pools.kv
    kv.k.clear()
    kv.v.clear()
