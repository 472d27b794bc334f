"""vLLM's ``LLMEngine``: the core ``Engine`` plus what vLLM clients read of it
(``from_engine_args``, ``model_config``, ``get_tokenizer``) and ``n`` samples per request, forked
into child requests and joined back (``parallel``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hyloop.api.engine_args import EngineArgs, EngineConfigs
from hyloop.api.parallel import ParallelSamples, forks_of
from hyloop.framework.engine import Engine
from hyloop.framework.outputs import RequestOutput
from hyloop.framework.requests import token_prompt
from hyloop.framework.sampling_params import SamplingParams


class LLMEngine(Engine, EngineConfigs):
    """``add_request`` / ``abort_request`` / ``step`` of the core engine, with ``n`` forks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parallel = ParallelSamples()  # the forks of n > 1 requests

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """vLLM's ``LLMEngine.from_engine_args``: the engine the arguments configure."""
        from hyloop.framework.assembly import build_engine

        engine = build_engine(args.create_engine_config(), engine_type=cls)
        assert isinstance(engine, LLMEngine)
        return engine

    def get_tokenizer(self) -> Any:  # vLLM's
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
        priority: int = 0,
    ) -> None:
        if isinstance(sampling_params, SamplingParams) and forks_of(sampling_params) > 1:
            where = f"request {request_id!r} sampling_params"
            sampling_params.validate(where, self.cfg.model.max_logprobs)
            return self._add_forks(request_id, prompt, sampling_params, arrival_time)
        super().add_request(request_id, prompt, sampling_params, arrival_time, lora_request)

    def _add_forks(
        self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float | None
    ) -> None:
        """``n`` samples: ``n`` child requests joined back in ``step``."""
        with self._lock:
            if request_id in self._parallel or request_id in self.scheduler:
                raise ValueError(f"request {request_id!r}: id already in use")
            forks = self._parallel.fork(request_id, params)
        added: list[str] = []
        try:
            for child, p in forks:
                super().add_request(child, prompt, p, arrival_time)
                added.append(child)
        except Exception:
            super().abort_request(added)
            self._parallel.forget(request_id)
            raise

    def _holds(self, request_id: str) -> bool:
        return request_id in self._parallel

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        if isinstance(request_id, str) and request_id in self._parallel:
            with self._lock:
                request_id = self._parallel.children(request_id)
        super().abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        with self._lock:  # abort_request may read the forks from another thread
            return self._parallel.join(outputs)

    def get_num_unfinished_requests(self) -> int:
        with self._lock:
            queued = len(self._queued_ids)
        return queued + len(self.scheduler.running) + len(self.scheduler.waiting)

    def validate_prompt(
        self, request_id: str, prompt: Any, params: SamplingParams | None = None
    ) -> list[int]:
        """The prompt's token ids, or a ValueError naming ``request_id`` and what is wrong."""
        truncate = params.truncate_prompt_tokens if params is not None else None
        return token_prompt(
            request_id, prompt, self.tokenizer, self.vocab_size, self.max_context, truncate
        )[1]

    def reset_prefix_cache(self) -> bool:
        """vLLM's: empty the prefix cache (and the donor index); False while requests run."""
        busy = self._in_step or self.has_unfinished_requests()
        return not busy and self.scheduler.cache.clear()
