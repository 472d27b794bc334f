"""Counter-based, sync-free sampling (a graph-native op).

Gumbel-max with noise from a hash of (request seed, output position, token id), after
temperature / top-k / top-p given as per-request tensors. A request's tokens therefore depend
only on its own logits, seed and positions: the same in eager, captured and lookahead runs and in
any batch composition. ``temperature == 0`` is greedy.

All integer arithmetic stays below 2**63 (32-bit values times 31-bit multipliers), so the noise is
bit-identical on CPU and GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x1B873593
_BELOW_ONE = 1.0 - 2.0**-24  # the largest fp32 below 1


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 values in ``[0, 2**32)`` (xorshift-multiply rounds)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def seed_hash(seeds: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash of int64 seeds that mixes both halves. NOTE: ``hash32(0) == 0``, so a seed
    below 2**32 hashes as it always has: those requests keep their tokens."""
    return hash32((seeds & _M32) ^ hash32((seeds >> 32) & _M32))


def token_hashes(vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """Per-token-id hashes, precomputed once per engine (int64 ``[V]``)."""
    return hash32(torch.arange(vocab_size, dtype=torch.int64, device=device) * 2 + 1)


def gumbel_noise(
    seeds: torch.Tensor, out_pos: torch.Tensor, tok_hash: torch.Tensor
) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[B, n]`` from ``seeds [B]`` (64-bit, ``fold_seed``), ``out_pos [B]``
    and the hashes of the tokens it is for: ``[V]`` (every token) or ``[B, n]`` (each row's
    candidates). A token's noise is the same either way: it depends only on (seed, position,
    token id)."""
    row = hash32(seed_hash(seeds) ^ (out_pos & _M32))
    h = hash32(row[:, None] ^ (tok_hash[None, :] if tok_hash.dim() == 1 else tok_hash))
    return -torch.log(-torch.log(uniform(h)))


def uniform(h: torch.Tensor) -> torch.Tensor:
    """fp32 values in (0, 1) from 32-bit hashes (their top 24 bits).

    NOTE: the top value, 1 - 2**-25, rounds to 1.0 in fp32, whose Gumbel noise is +inf: one
    token in 2**24 would win whatever its logit (and a masked -inf logit would turn NaN); it is
    held at the largest fp32 below 1."""
    return (((h >> 8).float() + 0.5) * (1.0 / (1 << 24))).clamp_max(_BELOW_ONE)


# Largest cap for a ``topk`` kernel (hyloop::topk_rows): its insertion costs grow with k.
NATIVE_TOPK_MAX = 64
TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    out_pos: torch.Tensor,
    tok_hash: torch.Tensor,
    top_cap: int,
    greedy_only: bool = False,
    topk: TopK | None = None,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Next token ids ``[B]`` (int64) from fp32 ``logits [B, V]``.

    ``top_k`` is the number of tokens kept (``-1`` or ``>= V`` to disable), ``top_p`` the
    nucleus mass (1.0 to disable). ``top_cap`` is static per captured artifact
    (``step_kinds.candidate_cap``): 0 samples the whole vocabulary unfiltered; otherwise each
    row samples among its ``top_cap`` largest logits (a ``topk``, or a full sort when the cap
    is the vocabulary), which hold its top-k.
    ``greedy_only`` (static) skips the noise when every row is greedy; the result is the same
    argmax either way. ``topk`` (the CPU kernel ``hyloop::topk_rows``, ties to the lower index)
    takes a cap of at most ``NATIVE_TOPK_MAX`` candidates; ``argmax`` (the CPU kernel
    ``hyloop::argmax_rows``) computes torch's argmax of each row.
    """
    # The first index of the row's largest logit (torch's CPU max over a dim runs three times
    # faster than its argmax, the same indices).
    greedy = argmax(logits) if argmax is not None else logits.max(dim=-1).indices
    if greedy_only:
        return greedy
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / temp[:, None]
    # temperature inf samples uniformly: finite logits scale to 0, a masked -inf stays out
    # (-inf / inf is NaN).
    scaled = scaled.masked_fill(scaled.isnan(), -torch.inf)
    vocab = logits.shape[-1]
    if top_cap == 0:
        sampled = (scaled + gumbel_noise(seeds, out_pos, tok_hash[:vocab])).argmax(dim=-1)
        return torch.where(temperature > 0, sampled, greedy)
    cap = min(top_cap, vocab)
    if topk is not None and cap <= NATIVE_TOPK_MAX:
        top, order = topk(scaled, cap)
    elif cap < vocab:
        top, order = scaled.topk(cap, dim=-1)
    else:
        top, order = scaled.sort(dim=-1, descending=True)
    top_k = torch.where(top_k > 0, top_k, cap)  # -1: off
    rank = torch.arange(cap, device=logits.device)
    in_top_k = rank[None, :] < top_k[:, None]
    # Top-k first, then the nucleus over the renormalised top-k (as HF / vLLM do). The mass is
    # a running sum over the row's own candidates, so it does not depend on the cap.
    weight = torch.where(in_top_k, (top - top[:, :1]).exp(), 0.0)
    mass = weight.cumsum(dim=-1)
    total = mass.gather(1, (top_k.clamp(1, cap) - 1)[:, None])
    keep = in_top_k & ((mass - weight < top_p[:, None] * total) | (top_p[:, None] >= 1.0))
    keep[:, 0] = True
    noise = gumbel_noise(seeds, out_pos, tok_hash[order])
    perturbed = torch.where(keep, top + noise, -torch.inf)
    sampled = order.gather(1, perturbed.argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(temperature > 0, sampled, greedy)


def repeated(logits: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """The repetition penalty's rule: a positive logit is divided, a negative one multiplied."""
    return torch.where(logits > 0, logits / penalty, logits * penalty)


def window_repetition_penalty(
    logits: torch.Tensor, ids: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """The repetition penalty (``features.penalties``' rule) over the ids of a window
    ``ids [B, W]`` (-1: empty) rather than a ``[B, V]`` count: the W seen logits are gathered
    and scattered back penalised (a repeat writes the same value twice, empties land in a spare
    column), which is far cheaper in a compiled step than a presence mask per vocabulary when
    the window is short (the audio codebooks of a frame step). ``penalty [B, 1]``."""
    b, v = logits.shape
    padded = torch.cat([logits, logits.new_zeros(b, 1)], dim=1)
    idx = torch.where((ids >= 0) & (ids < v), ids, v)
    seen = padded.gather(1, idx)
    return padded.scatter(1, idx, repeated(seen, penalty))[:, :v]


def token_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprob, rank)`` of the ``chosen`` ids (``logits [..., V]``, ``chosen [...]``) and the
    top ``k`` ``(logprobs, ids)``, under the raw model distribution."""
    lp = logits.log_softmax(dim=-1)
    picked = lp.gather(-1, chosen[..., None]).squeeze(-1)
    rank = (lp > picked[..., None]).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(k, dim=-1)
    return picked, rank, top_lp, top_ids
