"""The step object: one batch from the scheduler side to the kernels, and its capture buffer.

``StepBatch`` is what one batched forward reads. Its row fields are device tensors, one row per
request chunk over a padded ``[B, T]`` token layout (``T == 1`` in decode); its static values
(``kv_len``, the sampling mode with its ``features`` bits, ``is_decode``) are Python values a
captured artifact is specialised on. Per-request values that do not change while a request
runs (its sampling parameters, state the step itself updates) live in a ``RequestTable``:
device tensors of one row per req->token row, written once when a request takes its row and
read through ``req_rows``, so a captured step reads them like a pool and a per-request field
is declared once, where its value comes from (``column``).

Its fixed-address form, which a captured step reads, is ``graphs.capture.buffer.CaptureBuffer``.
``StepOutput`` is what a step returns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from hyloop.graphs.request_table import RequestTable, column

__all__ = [
    "Blend",
    "RequestTable",
    "StepBatch",
    "StepOutput",
    "StepPools",
    "column",
    "feature_bit",
    "feature_names",
    "ROW_FIELDS",
]

# A step's static ``features``: one bit per per-request feature it applies, named when the
# feature registers (``feature_bit``), and GREEDY, the sampler's own: every row is greedy (no
# Gumbel noise over the vocabulary at all).
GREEDY = 1
_BITS: dict[str, int] = {"greedy": GREEDY}
_PADDING_ROW = -1  # stands for the pool's padding row (``CaptureBuffer.init``)


def _row(pad: int = 0, tokens: bool = False) -> Any:
    """A per-row int64 field: ``[B, T]`` (``tokens``) or ``[B]``; ``pad`` is what an inert
    padding row holds."""
    return field(metadata={"pad": pad, "tokens": tokens})


@dataclass
class StepPools:
    """What every step of an engine shares, at fixed addresses."""

    req_to_token: torch.Tensor  # [max_requests + 1, max_context] int32
    kv: Any = None  # KVPool (per-layer .k / .v, and .swa for sliding-window layers)
    recurrent: Any = None  # RecurrentPool of hybrid models
    requests: RequestTable | None = None  # the step kind's per-request tensors
    compute: Any = None  # the models' compute path (attention kernels), chosen at assembly

    @property
    def padding_row(self) -> int:
        return self.req_to_token.shape[0] - 1


@dataclass(frozen=True)
class Blend:
    """Selective recompute in an eager prefill over KV a donor gave (CacheBlend): ``reused
    [B, T]`` marks those tokens. Every token runs the layers before ``check_layer``; from it on
    ``quota [B]`` tokens of each row do: the computed ones, then the reused ones whose K at
    ``check_layer`` deviates most from the donor's; the others keep the donor's KV. ``keep``
    (static, >= every quota) is how many run per row; a row's surplus writes the sink slot."""

    reused: torch.Tensor
    quota: torch.Tensor
    keep: int
    check_layer: int


@dataclass
class StepBatch:
    """One batched forward. Row ``b`` holds ``extend_lens[b]`` real new tokens (left-aligned)
    of the request whose req->token row is ``req_rows[b]``.

    NOTE: a padding row writes only KV slot 0 and state slot 0 (the sinks), reads the padding
    req->token row at position 0 (one key: the sink), samples greedily from the padding
    request-table row and publishes no track slot.
    """

    input_ids: torch.Tensor = _row(tokens=True)  # [B, T] token ids, or [B, T, C] rows
    positions: torch.Tensor = _row(tokens=True)  # [B, T] absolute positions
    out_cache_loc: torch.Tensor = _row(tokens=True)  # [B, T] KV slot each new token writes
    req_rows: torch.Tensor = _row(pad=_PADDING_ROW)  # [B] req->token (and request-table) row
    prefix_lens: torch.Tensor = _row()  # [B] tokens already in the KV
    extend_lens: torch.Tensor = _row()  # [B] real new tokens (0: a padding row)
    state_slots: torch.Tensor = _row()  # [B] recurrent working slot
    track_slots: torch.Tensor = _row()  # [B] track slot to publish the state into (0: none)
    out_pos: torch.Tensor = _row()  # [B] index in the output of the token being sampled
    keeps: torch.Tensor = _row()  # [B] 1: the sampled token is kept (not a mid-prompt chunk's)
    pools: StepPools
    kv_len: int  # static: table columns attention reads (>= max(prefix + extend))
    is_decode: bool = False  # static: one new token per row (the decode path of every layer)
    # static: a verify step (``hyloop.speculative``): row b's positions after the first are
    # its drafts, each position is sampled, and the output counts the tokens each row keeps
    verify: bool = False
    top_cap: int = 0  # static: sampler candidates (``step_kinds.candidate_cap``)
    num_logprobs: int = 0  # static: top logprobs returned per row
    keep_logits: bool = False  # static: the output keeps the logits
    # static: the bits of the per-request features the step applies (``feature_bit``) and
    # GREEDY; a neutral row's features leave its logits as they are
    features: int = 0
    # eager prefill only: the rows that want prompt logprobs, the top ones kept per position,
    # and those rows' next prompt token at each position ``[len(prompt_rows), T]`` (-1: none)
    prompt_rows: tuple[int, ...] = ()
    prompt_logprobs: int = 0
    prompt_targets: torch.Tensor | None = None
    blend: Blend | None = None  # eager prefill only: selective recompute of reused KV
    # Per-step values computed once and shared by every layer (attention indices, RoPE rows).
    meta: dict[Any, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def mode(self) -> tuple[int, int, int]:
        """The sampling mode an artifact is specialised on besides its two sizes."""
        return (self.top_cap, self.num_logprobs, self.features)

    def live_positions(self) -> torch.Tensor:
        """``[B, T]`` bool: whether each position is one of its row's real new tokens."""
        t = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        return t < self.extend_lens.view(-1, 1)

    def rows(self, start: int, stop: int) -> StepBatch:
        """Rows ``[start, stop)`` as views (a piece of a batch split across buckets)."""
        sliced: dict[str, Any] = {f.name: getattr(self, f.name)[start:stop] for f in ROW_FIELDS}
        if self.blend is not None:
            b = self.blend
            sliced["blend"] = dataclasses.replace(
                b, reused=b.reused[start:stop], quota=b.quota[start:stop]
            )
        return dataclasses.replace(self, **sliced, meta={})


# The per-row tensors of a ``StepBatch`` (declared with ``_row``), in order.
ROW_FIELDS = tuple(f for f in dataclasses.fields(StepBatch) if "pad" in f.metadata)


def feature_bit(name: str, flag: str | None = None) -> int:
    """The ``features`` bit of the feature ``name`` (a new name takes the next free bit);
    ``flag``: a read-only ``StepBatch`` property that says whether a step applies it."""
    if name not in _BITS:
        _BITS[name] = bit = 1 << len(_BITS)
        if flag is not None:
            setattr(StepBatch, flag, property(lambda b: bool(b.features & bit)))
    return _BITS[name]


def feature_names(bits: int) -> list[str]:
    """The names of the bits set in ``bits``, lowest first."""
    return [name for name, bit in _BITS.items() if bits & bit]


@dataclass
class StepOutput:
    """What a step returns; every tensor is batch-major."""

    next_ids: torch.Tensor  # [B] int64 (multi-channel models: the row keys)
    logits: torch.Tensor | None = None  # [B, V] (or [B, C, V]) fp32
    top_lp: torch.Tensor | None = None  # [B, K] logprobs of the top tokens
    top_ids: torch.Tensor | None = None  # [B, K]
    chosen_lp: torch.Tensor | None = None  # [B] logprob of the sampled token
    next_rows: torch.Tensor | None = None  # [B, C] multi-channel models
    chosen_rank: torch.Tensor | None = None  # [B] 1 + tokens more likely than the sampled one
    # a verify step: ``next_ids`` and the logprobs are per position ``[B, T]``, and each row
    # keeps its first ``accepted [B]`` tokens (its accepted drafts and the sample after them)
    accepted: torch.Tensor | None = None
    # prompt logprobs: the next prompt token's ``[B, T]`` logprob and rank, and the top ones
    prompt_lp: torch.Tensor | None = None
    prompt_rank: torch.Tensor | None = None
    prompt_top_lp: torch.Tensor | None = None  # [B, T, K]
    prompt_top_ids: torch.Tensor | None = None

    @property
    def feedback(self) -> torch.Tensor:
        """What the next decode step reads as its input: the rows, or the token ids."""
        return self.next_rows if self.next_rows is not None else self.next_ids

    def owned(self, n: int, keep_logits: bool) -> StepOutput:
        """The first ``n`` rows in fresh memory, which a later replay cannot overwrite."""
        kept = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if not keep_logits:
            kept["logits"] = None
        return StepOutput(**{k: None if t is None else t[:n].clone() for k, t in kept.items()})

    @staticmethod
    def concat(parts: list[StepOutput]) -> StepOutput:
        """The outputs of a batch split into pieces, joined back in row order."""
        joined = {}
        for f in dataclasses.fields(StepOutput):
            ts = [getattr(p, f.name) for p in parts]
            joined[f.name] = None if ts[0] is None else torch.cat(ts)
        return StepOutput(**joined)
