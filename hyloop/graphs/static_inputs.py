"""Step inputs of one decode step and the static buffers a captured step reads them from.

``StepInputs`` is what a step function reads: per-row device tensors (ids, positions, KV slots,
table rows, recurrent slots, sampling params) plus the values that are static per captured
artifact (``kv_len``, the sampling mode flags). ``StaticInputs`` owns buffers of ``max_bs`` rows;
``view(bs)`` gives the first ``bs`` rows as a ``StaticInputs`` sharing that storage, and
``copy_from(inputs)`` writes a batch into a view in place and fills the rest of it with inert
padding rows. A captured step is handed the same view on every replay, so no tensor address and
no Python value changes between replays.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from hyloop.graphs.context import StepContext

__all__ = ["ROW_FIELDS", "StaticInputs", "StepInputs"]

# Per-row tensor fields in declaration order: name -> (dtype, value a padded row holds).
# NOTE: a padded row writes only to KV slot 0 / state slot 0 (the padding sinks), reads the
# padding req->token row at position 0 (one key: the sink), samples greedily and publishes no
# track slot. ``req_rows`` padding is the pool's padding row, given at ``StaticInputs.init``.
ROW_FIELDS: dict[str, tuple[torch.dtype, int | float]] = {
    "input_ids": (torch.int64, 0),
    "positions": (torch.int64, 0),
    "out_cache_loc": (torch.int64, 0),
    "req_rows": (torch.int64, -1),
    "prefix_lens": (torch.int64, 0),
    "extend_lens": (torch.int64, 0),
    "state_slots": (torch.int64, 0),
    "track_slots": (torch.int64, 0),
    "temperature": (torch.float32, 0.0),
    "top_k": (torch.int64, 1),
    "top_p": (torch.float32, 1.0),
    "seeds": (torch.int64, 0),
    "out_pos": (torch.int64, 0),
}
_TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc")  # [B, T] (ids: [B, T] or [B, T, C])


@dataclass
class StepInputs:
    """One batched decode step: ``B`` rows, one request each, batch-major device tensors.

    ``input_ids`` is ``[B, 1]`` (token models) or ``[B, 1, C]`` (multi-channel rows);
    ``positions`` and ``out_cache_loc`` are ``[B, 1]``; every other tensor is ``[B]``. ``kv_len``
    (table columns attention reads, ``>= max(prefix_lens + extend_lens)``), ``top_cap`` (the
    sampler's candidate count, ``sampler.candidate_cap``) and ``num_logprobs`` are static per
    captured artifact.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    state_slots: torch.Tensor
    track_slots: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    out_pos: torch.Tensor
    kv_len: int
    top_cap: int = 0
    num_logprobs: int = 0

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def mode(self) -> tuple[int, int]:
        """The sampling mode flags that select a captured artifact besides the two sizes."""
        return (self.top_cap, self.num_logprobs)

    def validate(self) -> None:
        """Check shapes, dtypes and static values; reads no tensor value (no host sync)."""
        b = self.batch_size
        if b < 1:
            raise ValueError(f"StepInputs.input_ids: batch size {b}, expected >= 1")
        for name, (dtype, _) in ROW_FIELDS.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"StepInputs.{name}: got {type(t).__name__}, expected a tensor")
            if t.dtype != dtype:
                raise TypeError(f"StepInputs.{name}: dtype {t.dtype}, expected {dtype}")
            if name in _TOKEN_FIELDS:
                ok = t.dim() in ((2, 3) if name == "input_ids" else (2,)) and t.shape[:2] == (b, 1)
                want = "[B, 1] or [B, 1, C]" if name == "input_ids" else "[B, 1]"
            else:
                ok, want = tuple(t.shape) == (b,), "[B]"
            if not ok:
                raise ValueError(
                    f"StepInputs.{name}: shape {tuple(t.shape)}, expected {want} with B={b}"
                )
            if t.device != self.input_ids.device:
                raise ValueError(
                    f"StepInputs.{name}: on {t.device}, expected {self.input_ids.device} "
                    "like input_ids"
                )
        if isinstance(self.kv_len, bool) or not isinstance(self.kv_len, int) or self.kv_len < 1:
            raise ValueError(f"StepInputs.kv_len: {self.kv_len!r}, expected an int >= 1")
        if isinstance(self.top_cap, bool) or not isinstance(self.top_cap, int):
            raise TypeError(f"StepInputs.top_cap: {self.top_cap!r}, expected an int")
        if self.top_cap < 0:
            raise ValueError(f"StepInputs.top_cap: {self.top_cap}, expected >= 0")
        if isinstance(self.num_logprobs, bool) or not isinstance(self.num_logprobs, int):
            raise TypeError(f"StepInputs.num_logprobs: {self.num_logprobs!r}, expected an int")
        if self.num_logprobs < 0:
            raise ValueError(f"StepInputs.num_logprobs: {self.num_logprobs}, expected >= 0")

    def rows(self, start: int, stop: int) -> StepInputs:
        """Rows ``[start, stop)`` as views (a piece of a batch split across buckets)."""
        sliced = {name: getattr(self, name)[start:stop] for name in ROW_FIELDS}
        return dataclasses.replace(self, **sliced)

    def to_context(
        self, req_to_token: torch.Tensor, kv: Any = None, recurrent: Any = None
    ) -> StepContext:
        """The ``StepContext`` layers read; its tensors are these tensors (no copies)."""
        return StepContext(
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            req_rows=self.req_rows,
            prefix_lens=self.prefix_lens,
            extend_lens=self.extend_lens,
            req_to_token=req_to_token,
            kv_len=self.kv_len,
            kv=kv,
            recurrent=recurrent,
            state_slots=self.state_slots,
            track_slots=self.track_slots,
            is_decode=self.input_ids.shape[1] == 1,
        )


@dataclass
class StaticInputs(StepInputs):
    """Persistent buffers of a captured step, updated in place before every replay."""

    padding_row: int = 0

    @classmethod
    def init(
        cls,
        max_bs: int,
        *,
        padding_row: int,
        kv_len: int,
        device: torch.device | str,
        channels: int | None = None,
    ) -> StaticInputs:
        """Buffers for up to ``max_bs`` rows, every row a padding row.

        ``padding_row`` is the req->token row of the padding request (all slot 0); ``channels``
        makes ``input_ids`` ``[max_bs, 1, channels]`` for multi-channel rows.
        """
        if isinstance(max_bs, bool) or not isinstance(max_bs, int) or max_bs < 1:
            raise ValueError(f"StaticInputs.init: max_bs {max_bs!r}, expected an int >= 1")
        if padding_row < 0:
            raise ValueError(f"StaticInputs.init: padding_row {padding_row}, expected >= 0")
        if channels is not None and channels < 1:
            raise ValueError(f"StaticInputs.init: channels {channels}, expected >= 1 or None")
        buffers: dict[str, torch.Tensor] = {}
        for name, (dtype, pad) in ROW_FIELDS.items():
            shape: tuple[int, ...] = (max_bs,)
            if name in _TOKEN_FIELDS:
                shape = (max_bs, 1, channels) if name == "input_ids" and channels else (max_bs, 1)
            value = padding_row if name == "req_rows" else pad
            buffers[name] = torch.full(shape, value, dtype=dtype, device=device)
        return cls(**buffers, kv_len=kv_len, padding_row=padding_row)

    def view(
        self,
        bs: int,
        *,
        kv_len: int | None = None,
        top_cap: int | None = None,
        num_logprobs: int | None = None,
    ) -> StaticInputs:
        """The first ``bs`` rows, sharing storage; the static values default to this view's."""
        if not 1 <= bs <= self.batch_size:
            raise ValueError(f"StaticInputs.view: bs {bs}, expected 1..{self.batch_size}")
        sliced = {name: getattr(self, name)[:bs] for name in ROW_FIELDS}
        return dataclasses.replace(
            self,
            **sliced,
            kv_len=self.kv_len if kv_len is None else kv_len,
            top_cap=self.top_cap if top_cap is None else top_cap,
            num_logprobs=self.num_logprobs if num_logprobs is None else num_logprobs,
        )

    def copy_from(self, inputs: StepInputs) -> None:
        """Write ``inputs`` into the first rows in place; make the remaining rows padding.

        The static values must fit this view: ``inputs.kv_len <= kv_len`` and the same
        sampling mode flags, else the captured step would compute something else.
        """
        n, bs = inputs.batch_size, self.batch_size
        if n > bs:
            raise ValueError(f"StaticInputs.copy_from: batch of {n} rows, expected <= {bs}")
        if inputs.kv_len > self.kv_len:
            raise ValueError(
                f"StaticInputs.copy_from: kv_len {inputs.kv_len}, expected <= {self.kv_len}"
            )
        if inputs.mode != self.mode:
            raise ValueError(
                f"StaticInputs.copy_from: sampling mode (top_cap, num_logprobs) {inputs.mode}, "
                f"expected {self.mode}"
            )
        for name in ROW_FIELDS:
            getattr(self, name)[:n].copy_(getattr(inputs, name), non_blocking=True)
        self.fill_padding(n)

    def fill_padding(self, start: int = 0) -> None:
        """Make rows ``[start, bs)`` padding rows (all rows by default)."""
        if start >= self.batch_size:
            return
        for name, (_, pad) in ROW_FIELDS.items():
            getattr(self, name)[start:].fill_(self.padding_row if name == "req_rows" else pad)
