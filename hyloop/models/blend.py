"""Selective recompute over reused KV (CacheBlend, Yao et al. 2025), the model side.

A prefill chunk may hold tokens whose KV a donor gave at another offset (``Blend.reused``):
right after the shift their layer-0 K/V equal what this context computes, but every later layer
saw another context. The layers before ``check_layer`` run on every token of the chunk (and
write its exact KV). At ``check_layer`` each reused token's fresh K is compared with the
donor's; the chunk's computed tokens and the reused ones that deviate most (``Blend.quota`` per
row, counts the host chose, within a static width ``Blend.keep``) run the rest of the layers,
attending to the donor's KV of the others, which keep it. The choice is ``topk`` over device
tensors: no host sync, no shape that depends on a value.

It needs a decoder body of ``embed_tokens`` and ``layers`` whose layers have ``input_layernorm``
and a ``QKVAttention`` ``self_attn`` (a model says so in its contract: ``selective_recompute``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hyloop.graphs.ops import write_kv
from hyloop.graphs.step_batch import Blend, StepBatch


def kept_tokens(
    layer: nn.Module, x: torch.Tensor, batch: StepBatch, blend: Blend
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``[B, keep]`` (ascending) of the tokens that run ``layer`` and those after it,
    and which of them are in their row's quota: the computed tokens, then the reused ones by
    the squared deviation of their fresh K at ``layer`` from the donor's. Writes the fresh K/V
    of every token at ``layer``."""
    attn = layer.self_attn
    k, v = attn.keys_values(layer.input_layernorm(x), batch)
    pool = batch.pools.kv
    k_buf, v_buf = pool.k[attn.attn.pool_layer], pool.v[attn.attn.pool_layer]
    loc = batch.out_cache_loc
    # NOTE: K alone, as LMCache's blender: on SmolLM2 it picked better than K and V together
    # (bench/position_independent.py; first-token KL 0.023 against 0.037 at the same budget).
    dev = (k.float() - k_buf[loc].float()).square().sum((-2, -1))
    t = x.shape[1]
    real = torch.arange(t, device=x.device).view(1, t) < batch.extend_lens.view(-1, 1)
    score = torch.where(blend.reused, dev, torch.inf).masked_fill(~real, -torch.inf)
    best = score.topk(blend.keep, dim=1).indices  # best first: the quota is a leading run
    rank = torch.arange(blend.keep, device=x.device).view(1, -1)
    keep, order = best.sort(dim=1)
    wanted = (rank < blend.quota.view(-1, 1)).gather(1, order)
    write_kv(k_buf, v_buf, loc, k, v)  # the check layer's K/V is now this context's for all
    return keep, wanted


def blend_forward(body: nn.Module, batch: StepBatch) -> torch.Tensor:
    """Hidden states ``[B, T, H]`` of a chunk with reused tokens (``batch.blend``); rows at
    tokens that stopped at the check layer hold their input to it (no logits read them)."""
    blend = batch.blend
    assert blend is not None
    layers = body.layers
    if not 1 <= blend.check_layer < len(layers):
        raise ValueError(
            f"cache.position_independent.check_layer={blend.check_layer}: the model has "
            f"{len(layers)} layers; expected 1..{len(layers) - 1}"
        )
    x = body.embed_tokens(batch.input_ids)
    for layer in layers[: blend.check_layer]:
        x = layer(x, batch)
    keep, wanted = kept_tokens(layers[blend.check_layer], x, batch, blend)
    loc = batch.out_cache_loc.gather(1, keep)
    sub = dataclasses.replace(
        batch,
        input_ids=batch.input_ids.gather(1, keep),
        positions=batch.positions.gather(1, keep),
        out_cache_loc=torch.where(wanted, loc, 0),  # a row's surplus writes the sink slot
        blend=None,
        meta={},  # attention and RoPE rows of the kept tokens
    )
    index = keep.unsqueeze(-1).expand(-1, -1, x.shape[-1])
    before = x.gather(1, index)
    h = before
    for layer in layers[blend.check_layer :]:
        h = layer(h, sub)
    return x.scatter(1, index, torch.where(wanted.unsqueeze(-1), h, before))
