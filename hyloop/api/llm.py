"""The public entry point, vLLM's offline ``LLM``: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from hyloop.api.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from hyloop.api.chat import render_chat
from hyloop.api.engine import LLMEngine
from hyloop.api.engine_args import EngineArgs
from hyloop.framework.assembly import build_engine
from hyloop.framework.config import EngineConfig
from hyloop.framework.outputs import RequestOutput
from hyloop.framework.sampling_params import NotSupportedError, RequestOutputKind, SamplingParams
from hyloop.graphs.capture import Graphs


class LLM:
    """Offline generation over one engine, with vLLM's ``LLM`` surface.

    ``model``: an HF checkpoint directory or a ``.gguf`` file; ``config``: YAML file(s) or an
    ``EngineConfig``; ``overrides``: dotlist overrides such as ``["kv_pool.page_size=16"]``;
    any other keyword is one of vLLM's engine arguments (``EngineArgs``), mapped onto the config.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        config: str | Path | list[str | Path] | EngineConfig | None = None,
        overrides: list[str] | None = None,
        **engine_args: Any,
    ) -> None:
        args = EngineArgs(model=model, config=config, overrides=overrides, **engine_args)
        self._init(args)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm._init(args)
        return llm

    def _init(self, args: EngineArgs) -> None:
        self.engine_args = args
        self.config = args.create_engine_config()
        self.engine = build_engine(self.config, engine_type=LLMEngine)
        self._counter = 0
        self._closed = False
        self._draining = False  # ``drain()``: nothing more is admitted
        # One caller steps the engine at a time: a second thread's generate waits for it.
        self._calls = threading.RLock()
        self._finalizer = weakref.finalize(self, _close_engine, self.engine)

    @property
    def llm_engine(self) -> LLMEngine:
        return self.engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The checkpoint's tokenizer, HF-compatible (``tok(text)``, ``encode``, ``decode``,
        ``eos_token_id``, ``apply_chat_template``); None when the checkpoint ships none."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_params()

    @property
    def graphs(self) -> Graphs:
        """What the engine captures and when: buckets, artifacts, warm-up, the run's report."""
        return self.engine.graphs

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. ``prompts``: a str, a list of token ids, a TextPrompt /
        TokensPrompt dict, or a list of these."""
        outs = dict(self.generate_iter(prompts, sampling_params, use_tqdm, lora_request))
        return [outs[i] for i in range(len(outs))]

    def generate_iter(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """``(prompt index, finished output)`` as each request finishes (hyloop's addition:
        a writer can stream results while the rest still run). A call from another thread
        while one runs waits for it to end, then runs."""
        self._check_open("generate")
        if lora_request is not None:
            raise NotSupportedError("generate(): lora_request is not supported by hyloop")
        batch = as_batch(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(batch):
                raise ValueError(
                    f"sampling_params: {len(sampling_params)} given for {len(batch)} prompts"
                )
            params = list(sampling_params)
        else:
            params = [sampling_params or self.engine.default_params()] * len(batch)
        # Only finished outputs are needed: no per-step output copies while running.
        final = {
            id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            for p in params
            if isinstance(p, SamplingParams)
        }
        params = [final.get(id(p), p) for p in params]
        with self._calls:
            ids = []
            try:
                for prompt, p in zip(batch, params, strict=True):
                    rid = f"gen-{self._counter}"
                    self._counter += 1
                    self.engine.add_request(rid, prompt, p)
                    ids.append(rid)
            except Exception:  # what was queued goes, and leaves no output behind
                self.engine.abort_request(ids)
                if not self.engine.scheduler.running:  # nothing else runs: drain the aborts
                    self.engine.step()
                raise
            yield from self._run(ids, use_tqdm)

    def beam_search(
        self,
        prompts: Any,
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool | Callable[..., Any] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``beam_search``: per prompt, its ``params.beam_width`` best sequences (prompt
        ids included), best first; ``concurrency_limit`` prompts are searched at a time (None:
        all). How it runs: ``api.beam_search``."""
        self._check_open("beam_search")
        if lora_request is not None:
            raise NotSupportedError("beam_search(): lora_request is not supported by hyloop")
        with self._calls:
            search = BeamSearch(self.engine, params, tag=f"beam-{self._counter}")
            self._counter += 1
            return search.run(as_batch(prompts, "beam_search"), use_tqdm, concurrency_limit)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``chat``: each conversation rendered with the chat template (the checkpoint's
        or ``chat_template``), then generated from; message content may be OpenAI text parts."""
        if mm_processor_kwargs:
            raise NotSupportedError("chat(): mm_processor_kwargs (multimodal) is not supported")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [
            render_chat(
                f"chat conversation {i}",
                conv,
                self.engine.tokenizer,
                chat_template=chat_template,
                content_format=chat_template_content_format,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
            for i, conv in enumerate(convs)  # type: ignore[arg-type]
        ]
        return self.generate(texts, sampling_params, use_tqdm, lora_request)

    def _run(
        self, ids: list[str], use_tqdm: bool | Callable[..., Any]
    ) -> Iterator[tuple[int, RequestOutput]]:
        index = {rid: i for i, rid in enumerate(ids)}
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(ids), desc="requests", disable=not use_tqdm, dynamic_ncols=True)
        s0 = dict(self.engine.stats()) if use_tqdm else {}  # the bar's rates only
        shown = time.perf_counter()
        pending = set(ids)
        try:
            while pending and self.engine.has_unfinished_requests():
                if self._draining:
                    self.abort_unstarted()
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        bar.update(1)
                        yield index[out.request_id], out
                # The rates for a shown bar, a few times a second (a decode step takes ms).
                if use_tqdm and (now := time.perf_counter()) - shown > 0.25:
                    bar.set_postfix(_rates(s0, self.engine.stats()), refresh=False)
                    shown = now
        finally:  # a consumer that stops early (or an error) leaves nothing running
            self.engine.abort_request(pending)
            bar.close()

    def drain(self) -> None:
        """Admit nothing more: requests already running finish, the rest end ``abort`` (safe
        from a signal handler: it only sets a flag, read between steps)."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    def abort_unstarted(self) -> None:
        """Abort every queued request that has not started (no token sampled yet)."""
        waiting = self.engine.scheduler.waiting
        self.engine.abort_request([r.request_id for r in list(waiting) if not r.num_sampled])

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"LLM.{call}: this LLM was closed (LLM.close()); make a new one")

    def reset_prefix_cache(self) -> bool:
        """vLLM's: empty the prefix cache; False (nothing changed) while requests run."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def summary(self) -> str:
        from hyloop.api.summary import render_summary

        return render_summary(self)

    def close(self) -> None:
        self._closed = True
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


def _close_engine(engine: LLMEngine) -> None:
    engine.close()
    kv = engine.kind.pools.kv
    kv.k.clear()
    kv.v.clear()


def as_batch(prompts: Any, call: str = "generate") -> list[Any]:
    """The prompts of one ``generate`` (or ``beam_search``) call: a single prompt becomes a
    list of one."""
    if prompts is None:
        raise ValueError(
            f"{call}(): prompts is None; give a str, a list of token ids, a TextPrompt / "
            "TokensPrompt dict, or a list of these"
        )
    if isinstance(prompts, str | dict) or _is_token_list(prompts):
        return [prompts]
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise ValueError(
        f"{call}(): prompts of type {type(prompts).__name__}; expected a str, a list of "
        "token ids, a TextPrompt / TokensPrompt dict, or a list of these"
    )


def _is_token_list(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )
