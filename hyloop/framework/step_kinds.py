"""Step kinds: how a scheduled batch becomes a ``StepBatch``, and the step function over it.

A step kind owns its model, the request table its step reads and the two sets of step pools (its
eager steps' and, through the capture buffer, its captured steps'). ``build(batch)`` is the host
side of a step: device tensors for the batch's chunks (two host-to-device copies for a decode
step), the table rows of requests new to it, and the static values the step is specialised on.
``step(batch)`` is the unit a backend captures: forward, the recurrent track-slot scatter,
last-row logits, sampling and logprobs, all tensor ops with no host sync.

The token step is ``token_step.TokenStep``; the frame (TTS) step is
``hyloop.tts.frame_step.FrameStep``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from hyloop.cache.lease import Lease
from hyloop.features.base import Feature, RequestContext, table_with
from hyloop.framework import FEATURES
from hyloop.framework.requests import Batch, Chunk, Request, Status
from hyloop.framework.sampling_params import SamplingParams
from hyloop.graphs.capture import ArtifactKey
from hyloop.graphs.sampler import token_hashes
from hyloop.graphs.step_batch import GREEDY, RequestTable, StepBatch, StepPools, column


@dataclasses.dataclass
class TokenSampling(RequestTable):
    """Per-request sampling of a token step; each feature adds its own columns
    (``Feature.columns``). The padding row samples greedily."""

    temperature: torch.Tensor = column(torch.float32, 0.0, lambda r: r.params.sampling_temperature)
    top_k: torch.Tensor = column(torch.int64, -1, lambda r: r.params.filter_top_k)
    top_p: torch.Tensor = column(torch.float32, 1.0, lambda r: r.params.filter_top_p)
    seed: torch.Tensor = column(torch.int64, 0, lambda r: r.seed64)


class StepKind:
    """What every step kind shares: building ``StepBatch`` rows from a batch's chunks."""

    table: ClassVar[type[RequestTable]] = TokenSampling
    # The per-request features its step applies (``framework.FEATURES``), in order.
    feature_types: ClassVar[list[type[Feature]]] = FEATURES
    # Inductor options a compiled step of this kind takes on CPU unless the config sets them.
    cpu_compile_options: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        model: nn.Module,
        pools: StepPools,
        captured_compute: Any,
        vocab_size: int,
        max_context: int,
        kernels: Any = None,
        **dims: int,
    ) -> None:
        self.model = model
        self.device = pools.req_to_token.device
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.kernels = kernels  # the model's CPU kernels (``CpuKernels``), or None
        rows = pools.req_to_token.shape[0]
        self.features = [f(vocab_size, self.device) for f in self.feature_types]
        for f in self.features:
            dims.update(f.dims())
        table = table_with(self.table, list(self.feature_types))
        requests = table.allocate(rows, self.device, vocab=vocab_size, **dims)
        self.pools = dataclasses.replace(pools, requests=requests)
        self.captured_pools = dataclasses.replace(self.pools, compute=captured_compute)
        self.tok_hash = token_hashes(vocab_size, self.device)
        self.row_shape: tuple[int, ...] = ()
        # a captured step applies every sharing feature once any applies: fewer artifacts
        self.shared = sum(f.bit for f in self.features if f.shares_artifact)
        self._ahead: list[Feature] = []  # the features of the step launched ahead

    # -- what a batch samples with --------------------------------------------------------------
    def filter_group(self, params: SamplingParams) -> tuple[float, int, float]:
        """``(temperature, top_k, top_p)`` of the distribution whose filters size the step's
        sampler (``candidate_cap``)."""
        return (params.sampling_temperature, params.filter_top_k, params.filter_top_p)

    def samples(self, params: SamplingParams) -> bool:
        """Whether the request draws from noise at all (else it is greedy)."""
        return not params.greedy

    def mode(self, reqs: Iterable[Request], decode: bool = True) -> tuple[int, int, int]:
        """``(top_cap, num_logprobs, features)`` of a step over ``reqs``: ``features`` has the
        bit of each feature some request uses (of a ``decode`` step, every sharing one once
        any is), and ``GREEDY`` when none samples."""
        reqs = list(reqs)
        params = [r.params for r in reqs]
        nlp = max((max(p.logprobs, 1) for p in params if p.logprobs is not None), default=0)
        cap = candidate_cap([self.filter_group(p) for p in params], self.vocab_size)
        used = {name for r in reqs for name in r.features}
        bits = sum(f.bit for f in self.features if f.name in used)
        if decode and bits & self.shared:
            bits |= self.shared
        bits |= 0 if any(self.samples(p) for p in params) else GREEDY
        return cap, min(nlp, self.vocab_size), bits

    def attach(self, req: Request, ctx: RequestContext, where: str) -> None:
        """What each feature keeps of the new request ``req`` (``req.features``); a feature
        none of whose fields the request sets is not asked."""
        for f in self.features:
            if not req.params.sets_any(f.fields):
                continue
            state = f.attach(req, ctx, where)
            if state is not None:
                req.features[f.name] = state

    def host_fed(self, reqs: Iterable[Request]) -> bool:
        """Some request uses a feature whose rows the host writes after each step."""
        return any(f.host_fed and f.name in r.features for r in reqs for f in self.features)

    def prepare_capture(self, keys: Sequence[ArtifactKey]) -> None:
        """Before capturing ``keys``: nothing a token step must measure (the CPU kernels are a
        fixed rule, ``models/cpu/kernel_choice``)."""

    # -- host side of a step --------------------------------------------------------------------
    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the step's device. On CUDA the copy goes through pinned memory and
        is queued on the current stream, so preparing step N+2 never waits for step N+1."""
        if self.device.type != "cuda" or host.device.type == "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def build(self, batch: Batch, keep_logits: bool = False) -> StepBatch:
        """The step's ``StepBatch``; a ``planned`` batch's input ids are bound at launch."""
        chunks = batch.chunks
        for c in chunks:
            self.bind(c)
        top_cap, nlp, bits = self.mode((c.req for c in chunks), batch.is_decode)
        static = dict(top_cap=top_cap, num_logprobs=nlp, keep_logits=keep_logits, features=bits)
        if batch.verify:
            return self._prefill(chunks, verify=True, **static)
        if batch.is_decode:
            return self._decode(chunks, batch.planned, **static)
        return self._prefill(chunks, **static)

    def bind(self, chunk: Chunk) -> None:
        """``chunk``'s request takes its step-table row, if new to it (its values, then each
        of its features' ``take``): one request's part of ``build``."""
        table, req = self.pools.requests, chunk.req
        assert table is not None
        row = _lease(chunk).req_row
        if table.owners[row] is req:
            return
        table.take(row, req, {n: of(req) for n, of in table.sources(req.features).items()})
        for f in self.features:
            if f.name in req.features:
                f.take(table, row, req.features[f.name])

    def _decode(self, chunks: list[Chunk], planned: bool, **static: Any) -> StepBatch:
        """Every per-row int goes to the device in one tensor; the new tokens' KV slots are
        then gathered from the req->token table on the device."""
        n, pos = len(chunks), [c.start for c in chunks]
        ints = [
            pos,
            [_lease(c).req_row for c in chunks],
            [_lease(c).state_slot for c in chunks],
            [c.track_slot for c in chunks],
            _out_pos(chunks),
        ]
        if not planned and not self.row_shape:
            ints.append([c.req.output_ids[-1] for c in chunks])
        packed = self.to_device(torch.tensor(ints, dtype=torch.int64))
        positions, rows = packed[0], packed[1]
        if planned:
            ids = torch.zeros(n, 1, *self.row_shape, dtype=torch.int64, device=self.device)
        elif self.row_shape:
            ids = self.to_device(self.last_rows(chunks)).view(n, 1, *self.row_shape)
        else:
            ids = packed[5].view(n, 1)
        return StepBatch(
            input_ids=ids,
            positions=positions.view(-1, 1),
            out_cache_loc=self.pools.req_to_token[rows, positions].to(torch.int64).view(-1, 1),
            req_rows=rows,
            prefix_lens=positions,
            extend_lens=torch.ones_like(positions),
            state_slots=packed[2],
            track_slots=packed[3],
            out_pos=packed[4],
            keeps=torch.ones_like(positions),
            pools=self.pools,
            kv_len=max(pos) + 1,
            is_decode=True,
            **static,
        )

    def advance(self, batch: Batch, i: int, token: int) -> None:
        """Row ``i``'s request of a resolved step takes its ``token``: each of its features'
        host ``advance`` (a structured output's next mask)."""
        req, c = batch.chunks[i].req, batch.chunks[i]
        if not req.features or req.status is not Status.RUNNING or req.lease is None:
            return  # none, or a step that rode along after it finished
        if batch.is_decode or c.completes_prompt:
            table = self.pools.requests
            assert table is not None
            for f in self.features:
                if f.name in req.features:
                    f.advance(table, req.lease.req_row, req.features[f.name], token)

    def run_ahead(self, batch: StepBatch) -> None:
        """``batch`` is launched before the step it follows is resolved: the features it
        applies are told (and settled once that step is)."""
        self._ahead = [f for f in self.features if batch.features & f.bit]
        for f in self._ahead:
            f.run_ahead(batch)

    def settle(self) -> None:
        """The step launched ahead may read what the host writes: it is written."""
        ahead, self._ahead = self._ahead, []
        for f in ahead:
            f.settle()

    def last_rows(self, chunks: list[Chunk]) -> torch.Tensor:
        """The rows a decode step of a multi-channel kind reads (a token kind reads ids)."""
        raise NotImplementedError(f"{type(self).__name__} reads token ids, not rows")

    def prefill_inputs(self, req: Request, start: int, length: int) -> torch.Tensor:
        """Input ids (or rows) of ``length`` prompt positions from ``start``."""
        ids = (req.prompt_ids + req.output_ids)[start : start + length]
        return torch.tensor(ids, dtype=torch.int64)

    def _prefill(self, chunks: list[Chunk], verify: bool = False, **static: Any) -> StepBatch:
        """Chunks of ``[B, T]`` rows, padded to the longest chunk (a verify step's: a decode
        row and its drafts, every position sampled)."""
        b, t = len(chunks), max(c.length for c in chunks)
        ids = torch.zeros(b, t, *self.row_shape, dtype=torch.int64)
        pos = torch.zeros(b, t, dtype=torch.int64)
        loc = torch.zeros(b, t, dtype=torch.int64)
        limit = self.max_context - 1
        for i, c in enumerate(chunks):
            n = c.length - len(c.drafts)  # a verify chunk's drafts follow its known tokens
            ids[i, :n] = self.prefill_inputs(c.req, c.start, n)
            if c.drafts:
                ids[i, n : c.length] = torch.tensor(c.drafts, dtype=torch.int64)
            pos[i] = torch.arange(c.start, c.start + t).clamp_max(limit)
            loc[i, : c.length] = _lease(c).slots[c.start : c.start + c.length]
        per_row = torch.tensor(
            [
                [_lease(c).req_row for c in chunks],
                [c.start for c in chunks],
                [c.length for c in chunks],
                [_lease(c).state_slot for c in chunks],
                [c.track_slot for c in chunks],
                _out_pos(chunks),
                [int(c.completes_prompt or verify) for c in chunks],
            ],
            dtype=torch.int64,
        )
        rows, prefix, ext, state, track, out_pos, keeps = self.to_device(per_row)
        asks = [] if verify else chunks  # a verify step reads no prompt logprobs
        wants = [i for i, c in enumerate(asks) if c.req.params.prompt_logprobs is not None]
        k = max((chunks[i].req.params.prompt_logprobs or 0 for i in wants), default=-1)
        targets = None
        if wants:  # the wanting rows' next prompt token at each position (-1: none)
            targets = torch.full((len(wants), t), -1, dtype=torch.int64)
            for j, i in enumerate(wants):
                c = chunks[i]
                nxt = c.req.prompt_ids[c.start + 1 : c.start + c.length + 1]
                targets[j, : len(nxt)] = torch.tensor(nxt, dtype=torch.int64)
            targets = self.to_device(targets)
        # selective recompute of reused spans (``position_independent.reuse``), if any has some
        policies = [_lease(c).selective for c in chunks if _lease(c).selective is not None]
        blend = policies[0].blend(chunks, t, self.to_device) if policies else None
        return StepBatch(
            input_ids=self.to_device(ids),
            positions=self.to_device(pos),
            out_cache_loc=self.to_device(loc),
            req_rows=rows,
            prefix_lens=prefix,
            extend_lens=ext,
            state_slots=state,
            track_slots=track,
            out_pos=out_pos,
            keeps=keeps,
            pools=self.pools,
            kv_len=max(c.start + c.length for c in chunks),
            prompt_logprobs=k,
            prompt_rows=tuple(wants),
            prompt_targets=targets,
            blend=blend,
            verify=verify,
            **static,
        )


def _lease(c: Chunk) -> Lease:
    assert c.req.lease is not None, f"request {c.req.request_id!r} holds no lease"
    return c.req.lease


def _out_pos(chunks: list[Chunk]) -> list[int]:
    """The output index each chunk samples at (a mid-prompt chunk's token is discarded)."""
    return [c.out_pos if c.out_pos >= 0 else len(c.req.output_ids) for c in chunks]


def candidate_cap(groups: Iterable[tuple[float, int, float]], vocab: int) -> int:
    """The static candidate count of a batch's sampler from each row's ``(temperature, top_k,
    top_p)`` (``top_k == -1``: off): 0 when no sampling row filters (plain Gumbel-max over the
    vocabulary), else the next power of two covering every sampling row's top-k (few distinct
    artifacts), or the whole vocabulary when some sampling row keeps more than a top-k (no top-k,
    or top-p alone). Sampling over the capped candidates is exact: a row's top-k lies within
    them and nothing outside its top-k can be drawn."""
    widest, filtering = 0, False
    for temperature, top_k, top_p in groups:
        if temperature <= 0:
            continue
        k = vocab if top_k == -1 else min(top_k, vocab)
        filtering = filtering or k < vocab or top_p < 1.0
        widest = max(widest, k)
    if not filtering:
        return 0
    return min(vocab, 1 << (widest - 1).bit_length())
