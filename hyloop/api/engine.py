"""vLLM's ``LLMEngine``: the core ``Engine`` plus what vLLM clients read of it
(``from_engine_args``, ``model_config``, ``get_tokenizer``) and ``n`` samples per request.

``n`` parallel samples of one prompt: the request forks into ``n`` child requests (sample ``j``
seeded ``seed + j`` as vLLM seeds it, or drawn like any unseeded request), which share the
prompt's KV through the radix tree (the scheduler holds a fork back until its sibling's prefix
is cached), and their outputs are joined back under the parent's id as ``outputs[0..n-1]``.
``best_of = m > n`` (vLLM's older field) forks ``m`` and keeps the ``n`` of highest cumulative
logprob, once all finished."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hyloop.api.engine_args import EngineArgs, EngineConfigs
from hyloop.framework.engine import Engine
from hyloop.framework.outputs import CompletionOutput, RequestOutput
from hyloop.framework.prompts import token_prompt
from hyloop.framework.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Parent:
    request_id: str
    n: int
    forks: int
    kind: RequestOutputKind
    strip_logprobs: bool  # logprobs computed only to rank best_of forks
    children: list[str] = field(default_factory=list)
    dropped: bool = False  # its add failed: its forks' (abort) outputs are swallowed
    samples: dict[int, CompletionOutput] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)


def forks_of(params: SamplingParams) -> int:
    """Child requests a request forks into (1: it runs as itself)."""
    n, best_of = params.n, params.best_of
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (n, best_of or 1))
    return max(n, best_of or 1) if ints else 1


class ParallelSamples:
    """The forks of every running ``n > 1`` request, keyed by child id."""

    def __init__(self) -> None:
        self._children: dict[str, tuple[_Parent, int]] = {}
        self.parents: dict[str, _Parent] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents

    def fork(self, request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """The child requests of ``request_id``: ids ``{j}_{request_id}``."""
        m = forks_of(params)
        ranked = m > params.n and params.logprobs is None
        parent = _Parent(request_id, params.n, m, params.output_kind, ranked)
        logprobs = 0 if ranked else params.logprobs
        # best_of forks show nothing before the end: each returns its whole output once
        kind = RequestOutputKind.FINAL_ONLY if m > params.n else params.output_kind
        forks = []
        for j in range(m):
            seed = params.seed + j if params.seed is not None else None
            child = dataclasses.replace(
                params, n=1, best_of=None, seed=seed, logprobs=logprobs, output_kind=kind
            )
            forks.append((f"{j}_{request_id}", child))
            self._children[forks[-1][0]] = (parent, j)
            parent.children.append(forks[-1][0])
        self.parents[request_id] = parent
        return forks

    def children(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.children) if parent else []

    def forget(self, request_id: str) -> None:
        """A parent whose add failed: it is gone, and what its queued forks return (their
        abort outputs) is swallowed."""
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            parent.dropped = True

    def join(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs with each child's replaced by its parent's: ``final_only`` (and ``best_of``)
        parents appear once, when every sample finished; streaming ones at each child output,
        with every sample so far (``cumulative``) or the one that child output carries
        (``delta``, vLLM's parallel-sampling outputs)."""
        out = []
        for o in outputs:
            entry = self._children.get(o.request_id)
            if entry is None:
                out.append(o)
                continue
            parent, j = entry
            if parent.dropped:
                if o.finished:
                    del self._children[o.request_id]
                continue
            sample = dataclasses.replace(o.outputs[0], index=j)
            parent.samples[j] = sample
            if o.finished:
                parent.finished.add(j)
                del self._children[o.request_id]
            done = len(parent.finished) == parent.forks
            ranked = parent.forks > parent.n  # best_of: only the finished best n show
            if not done and (parent.kind is RequestOutputKind.FINAL_ONLY or ranked):
                continue
            if parent.kind is RequestOutputKind.DELTA and not ranked:
                shown = [sample]
            else:
                shown = [parent.samples[k] for k in sorted(parent.samples)]
            if done and ranked:
                shown = _best(shown, parent.n, parent.strip_logprobs)
            joined = dataclasses.replace(
                o, request_id=parent.request_id, outputs=shown, finished=done
            )
            if done:
                del self.parents[parent.request_id]
            out.append(joined)
        return out


def _best(samples: list[CompletionOutput], n: int, strip: bool) -> list[CompletionOutput]:
    """The ``n`` samples of highest cumulative logprob, indexed ``0..n-1``."""
    ranked = sorted(samples, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]
    return [
        dataclasses.replace(c, index=i, logprobs=None if strip else c.logprobs)
        for i, c in enumerate(ranked)
    ]


class LLMEngine(Engine, EngineConfigs):
    """``add_request`` / ``abort_request`` / ``step`` of the core engine, with ``n`` forks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parallel = ParallelSamples()  # the forks of n > 1 requests
        self.reserved_ids = self._parallel.parents

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
