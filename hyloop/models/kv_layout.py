"""Where each attention layer's K/V live and which keys its queries see: one ``KVView`` per
layer, placed from the model contract's ``kv_windows`` (``contract.place_kv_layers``).

Keys of row ``b`` are the first ``kv_len`` columns of its req->token row; key column ``j`` (=
absolute position ``j``) is visible to a query at position ``p`` iff ``j <= p`` and, on a
sliding-window layer, ``j > p - window``. Prefill masks those columns; a decode step whose
``kv_len`` exceeds the window reads only the window's columns of each row (a static
``[B, window]`` gather), so its cost stops growing with the context. Sliding-window layers may
keep a pool of their own (``pools.SWAKVPool``): a token's identity stays its full-pool slot,
translated into that pool through ``full_to_swa``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyloop.graphs.step_batch import StepBatch


@dataclass
class AttentionMeta:
    """Per step and view, shared by the layers: context slots and what each row sees."""

    slots: torch.Tensor  # [B * L] KV slots of the columns read
    mask: torch.Tensor  # prefill: bool [B, 1, T, L]; decode: fp32 bias [B, 1, 1, L] (0 / -inf)
    loc: torch.Tensor  # [B, T] slots the new tokens write


@dataclass(frozen=True)
class KVView:
    """Layer ``layer`` of the full pool (or of the sliding-window pool, ``own_pool``); its
    queries see the ``window`` keys up to their own (None: all of them)."""

    layer: int = 0
    window: int | None = None
    own_pool: bool = False

    def buffers(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        pool = batch.pools.kv.swa if self.own_pool else batch.pools.kv
        return pool.k[self.layer], pool.v[self.layer]

    def meta(self, batch: StepBatch) -> AttentionMeta:
        return attention_meta(batch, self.window, self.own_pool)


def attention_meta(
    batch: StepBatch, window: int | None = None, own_pool: bool = False
) -> AttentionMeta:
    """The step's ``AttentionMeta`` for one view, built by the first layer that needs it."""
    key = ("attention", window, own_pool)
    meta = batch.meta.get(key)
    if meta is None:
        meta = batch.meta[key] = _build_meta(batch, window, own_pool)
    return meta


def _build_meta(batch: StepBatch, window: int | None, own_pool: bool) -> AttentionMeta:
    b, t = batch.positions.shape
    device = batch.positions.device
    table = batch.pools.req_to_token
    zero = torch.zeros((), dtype=torch.float32, device=device)
    if window is not None and t == 1 and batch.kv_len > window:
        # Decode on a sliding layer reads only its window, columns (p - window, p] of each row
        # (static shape [B, window]; columns before 0 are masked and read slot 0).
        cols = batch.positions.view(b, 1) - (window - 1) + torch.arange(window, device=device)
        rows = batch.req_rows.view(b, 1)
        slots = table[rows, cols.clamp(min=0)].reshape(-1).long()
        mask = torch.where(cols >= 0, zero, float("-inf")).view(b, 1, 1, window)
    else:
        slots = table[batch.req_rows, : batch.kv_len].reshape(-1).long()
        cols = torch.arange(batch.kv_len, device=device).view(1, 1, 1, -1)
        pos = batch.positions.view(b, 1, t, 1)
        visible = cols <= pos
        if window is not None:
            visible = visible & (cols > pos - window)
        mask = torch.where(visible, zero, float("-inf")) if t == 1 else visible
    loc = batch.out_cache_loc
    if own_pool:  # token identity is the full-pool slot: translate into the window pool
        full_to_swa = batch.pools.kv.swa.full_to_swa
        loc = full_to_swa.index_select(0, loc.reshape(-1)).view(loc.shape)
        slots = full_to_swa.index_select(0, slots)
    return AttentionMeta(slots, mask, loc)
