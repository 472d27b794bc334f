"""``CaptureBuffer``: the fixed-address form of ``StepBatch`` that captured steps read.

``init(max_bs)`` allocates the rows (a verify step's buffer: several positions per row),
``view(bs, ...)`` is a ``StepBatch`` over the first rows with an artifact's static values, and
``copy_from(view, batch)`` writes a batch's rows in place and makes the rest inert padding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hyloop.graphs.step_batch import ROW_FIELDS, StepBatch, StepPools


@dataclass
class CaptureBuffer:
    """Persistent row buffers of ``max_bs`` rows that captured steps read, updated in place."""

    full: StepBatch

    @classmethod
    def init(
        cls,
        max_bs: int,
        pools: StepPools,
        kv_len: int,
        channels: int | None = None,
        tokens: int = 1,
    ) -> CaptureBuffer:
        """Buffers for up to ``max_bs`` rows, all padding rows; ``channels`` makes
        ``input_ids`` ``[max_bs, 1, channels]`` (multi-channel rows); ``tokens > 1``: a verify
        step's, that many positions per row (its views take the first few)."""
        if isinstance(max_bs, bool) or not isinstance(max_bs, int) or max_bs < 1:
            raise ValueError(f"CaptureBuffer.init: max_bs {max_bs!r}, expected an int >= 1")
        device = pools.req_to_token.device
        rows = {}
        for f in ROW_FIELDS:
            shape: tuple[int, ...] = (max_bs, tokens) if f.metadata["tokens"] else (max_bs,)
            if f.name == "input_ids" and channels:
                shape = (max_bs, 1, channels)
            rows[f.name] = torch.zeros(shape, dtype=torch.int64, device=device)
        full = StepBatch(
            **rows,
            pools=pools,
            kv_len=kv_len,
            is_decode=tokens == 1,
            verify=tokens > 1,
            keep_logits=True,
        )
        buffer = cls(full)
        buffer.fill_padding(buffer.full)
        return buffer

    @property
    def max_bs(self) -> int:
        return self.full.batch_size

    def view(
        self,
        bs: int,
        kv_len: int,
        top_cap: int = 0,
        num_logprobs: int = 0,
        features: int = 0,
        tokens: int = 1,
    ) -> StepBatch:
        """The first ``bs`` rows (shared storage) with these static values; ``features``: the
        bits of the features applied (a neutral row's are no-ops; padding rows are greedy);
        ``tokens``: a verify buffer's positions per row."""
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"CaptureBuffer.view: bs {bs}, expected 1..{self.max_bs}")
        t = tokens if self.full.verify else 1
        rows = {
            f.name: getattr(self.full, f.name)[:bs, :t]
            if f.metadata["tokens"] and t > 1
            else getattr(self.full, f.name)[:bs]
            for f in ROW_FIELDS
        }
        return dataclasses.replace(
            self.full,
            **rows,
            kv_len=kv_len,
            top_cap=top_cap,
            num_logprobs=num_logprobs,
            features=features,
            meta={},
        )

    @staticmethod
    def copy_from(view: StepBatch, batch: StepBatch) -> None:
        """Write ``batch``'s rows into ``view`` in place and make its other rows padding. The
        static values must fit the view, else the captured step would compute something else."""
        n, bs = batch.batch_size, view.batch_size
        if n > bs:
            raise ValueError(f"CaptureBuffer.copy_from: batch of {n} rows, expected <= {bs}")
        if batch.kv_len > view.kv_len:
            raise ValueError(
                f"CaptureBuffer.copy_from: kv_len {batch.kv_len}, expected <= {view.kv_len}"
            )
        t, room = batch.input_ids.shape[1], view.input_ids.shape[1]
        if batch.verify != view.verify or (batch.verify and t > room):
            raise ValueError(
                f"CaptureBuffer.copy_from: verify={batch.verify} with {t} positions per row, "
                f"expected verify={view.verify} with at most {room}"
            )
        if batch.mode != view.mode:
            raise ValueError(
                f"CaptureBuffer.copy_from: mode (top_cap, num_logprobs, features) {batch.mode}, "
                f"expected {view.mode}"
            )
        for f in ROW_FIELDS:
            dst, src = getattr(view, f.name)[:n], getattr(batch, f.name)
            if f.metadata["tokens"] and src.shape[1] < dst.shape[1]:  # a verify row's tail
                dst[:, src.shape[1] :].fill_(0)
                dst = dst[:, : src.shape[1]]
            dst.copy_(src, non_blocking=True)
        CaptureBuffer.fill_padding(view, n)

    @staticmethod
    def fill_padding(view: StepBatch, start: int = 0) -> None:
        """Make rows ``[start, bs)`` of ``view`` padding rows (all rows by default)."""
        if start >= view.batch_size:
            return
        for f in ROW_FIELDS:
            pad = f.metadata["pad"]
            getattr(view, f.name)[start:].fill_(view.pools.padding_row if pad < 0 else pad)
