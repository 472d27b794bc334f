"""``n`` parallel samples of one prompt: the request forks into ``n`` child requests (sample
``j`` seeded ``seed + j`` as vLLM seeds it, or drawn like any unseeded request), which share the
prompt's KV through the radix tree (the scheduler holds a fork back until its sibling's prefix
is cached), and their outputs are joined back under the parent's id as ``outputs[0..n-1]``.
``best_of = m > n`` (vLLM's older field) forks ``m`` and keeps the ``n`` of highest cumulative
logprob, once all finished."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hyloop.framework.outputs import CompletionOutput, RequestOutput
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
    last: RequestOutput | None = None
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
        self._parents: dict[str, _Parent] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

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
        for j, (child, _) in enumerate(forks):
            self._children[child] = (parent, j)
            parent.children.append(child)
        self._parents[request_id] = parent
        return forks

    def children(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return list(parent.children) if parent else []

    def forget(self, request_id: str) -> None:
        """A parent whose add failed: it is gone, and what its queued forks return (their
        abort outputs) is swallowed."""
        parent = self._parents.pop(request_id, None)
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
                del self._parents[parent.request_id]
            out.append(joined)
        return out


def _best(samples: list[CompletionOutput], n: int, strip: bool) -> list[CompletionOutput]:
    """The ``n`` samples of highest cumulative logprob, indexed ``0..n-1``."""
    ranked = sorted(samples, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]
    return [
        dataclasses.replace(c, index=i, logprobs=None if strip else c.logprobs)
        for i, c in enumerate(ranked)
    ]
