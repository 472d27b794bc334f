"""Selective recompute over reused KV (CacheBlend, Yao et al. 2025), the model side.

A prefill chunk may hold tokens whose KV a donor gave at another offset (``Blend.reused``):
right after the shift their layer-0 K/V equal what this context computes, but every later layer
saw another context. The layers before ``check_layer`` run on every token of the chunk (and
write its exact KV). At ``check_layer`` each reused token is scored by how far its fresh K is
from the donor's, weighted by how much the chunk's last tokens attend to it; the chunk's
computed tokens and the reused ones that score highest (``Blend.quota`` per row, counts the
host chose, within a static width ``Blend.keep``) run the rest of the layers, attending to the
donor's KV of the others, which keep it. The choice is ``topk`` over device tensors: no host
sync, no shape that depends on a value.

Why the weight: a reused token's error reaches the output through the attention paid to it,
so a deviation nobody reads costs nothing. The chunk that completes a prompt ends with the
query, whose attention is the one the first sampled token follows (the scheduler gives a
selective request's prompt one chunk where it can: ``SelectiveRecompute.fit``). On SmolLM2's
two RAG workloads (``bench/position_independent.py``, 15% of the reused tokens recomputed)
deviation times that attention at layer 3 took the mean first-token KL against reuse off to
0.0077 / 0.0087, where deviation alone at layer 1 in 512-token chunks gave 0.014 on the first.

It needs a decoder body of ``embed_tokens`` and ``layers`` whose layers have ``input_layernorm``
and a ``QKVAttention`` ``self_attn`` (a model says so in its contract: ``selective_recompute``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hyloop.graphs.ops import write_kv
from hyloop.graphs.step_batch import Blend, StepBatch

OBSERVERS = 16  # a chunk's last tokens whose attention weighs each reused token's deviation


def observed(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """``[B, T]``: the attention each token of a row gets from the row's last ``OBSERVERS``
    tokens (``lengths`` real tokens a row), over the chunk, mean over observers and heads."""
    b, t, heads, d = q.shape
    n = min(OBSERVERS, t)
    last = (lengths.view(-1, 1) - 1 - torch.arange(n, device=q.device).view(1, n)).clamp_min(0)
    qo = q.gather(1, last.view(b, n, 1, 1).expand(-1, -1, heads, d)).float()
    kk = k.float().repeat_interleave(heads // k.shape[2], dim=2)  # query head h reads h // g
    s = torch.einsum("bohd,bthd->bhot", qo, kk) * scale
    causal = torch.arange(t, device=q.device).view(1, 1, 1, t) <= last.view(b, 1, n, 1)
    return s.masked_fill(~causal, -torch.inf).softmax(-1).mean((1, 2))


def kept_tokens(
    layer: nn.Module, x: torch.Tensor, batch: StepBatch, blend: Blend
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``[B, keep]`` (ascending) of the tokens that run ``layer`` and those after it,
    and which of them are in their row's quota: the computed tokens, then the reused ones by
    the squared deviation of their fresh K at ``layer`` from the donor's times the attention the
    row's last tokens pay them there (``observed``). Writes the fresh K/V
    of every token at ``layer``."""
    attn = layer.self_attn
    q, k, v, _ = attn.queries_keys_values(layer.input_layernorm(x), batch)
    k_buf, v_buf = attn.attn.view.buffers(batch)
    loc = batch.out_cache_loc
    # NOTE: K alone, as LMCache's blender: on SmolLM2 it picked better than K and V together
    # (bench/position_independent.py; first-token KL 0.023 against 0.037 at the same budget).
    dev = (k.float() - k_buf[loc].float()).square().sum((-2, -1))
    dev = dev * observed(q, k, batch.extend_lens, attn.attn.scale)
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
    if len(layers) < 2:
        raise ValueError(f"selective recompute needs 2 layers or more; the model has {len(layers)}")
    check = min(blend.check_layer, len(layers) - 1)  # a shallower model: its last layer but one
    x = body.embed_tokens(batch.input_ids)
    for layer in layers[:check]:
        x = layer(x, batch)
    keep, wanted = kept_tokens(layers[check], x, batch, blend)
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
    for layer in layers[check:]:
        h = layer(h, sub)
    return x.scatter(1, index, torch.where(wanted.unsqueeze(-1), h, before))
