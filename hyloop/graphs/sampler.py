"""Counter-based, sync-free sampling (a graph-native op).

Gumbel-max with noise from a hash of (request seed, output position, token id), after
temperature / top-k / top-p given as per-request tensors. A request's tokens therefore depend
only on its own logits, seed and positions: the same in eager, captured and lookahead runs and in
any batch composition. ``temperature == 0`` is greedy.

All integer arithmetic stays below 2**63 (32-bit values times 31-bit multipliers), so the noise is
bit-identical on CPU and GPU.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x1B873593


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 values in ``[0, 2**32)`` (xorshift-multiply rounds)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def token_hashes(vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """Per-token-id hashes, precomputed once per engine (int64 ``[V]``)."""
    return hash32(torch.arange(vocab_size, dtype=torch.int64, device=device) * 2 + 1)


def gumbel_noise(
    seeds: torch.Tensor, out_pos: torch.Tensor, tok_hash: torch.Tensor
) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[B, V]`` from ``seeds [B]`` (32-bit), ``out_pos [B]`` and ``[V]``."""
    row = hash32(hash32(seeds) ^ (out_pos & _M32))
    h = hash32(row[:, None] ^ tok_hash[None, :])
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24 bits
    return -torch.log(-torch.log(u))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    out_pos: torch.Tensor,
    tok_hash: torch.Tensor,
    filtered: bool,
    greedy_only: bool = False,
) -> torch.Tensor:
    """Next token ids ``[B]`` (int64) from fp32 ``logits [B, V]``.

    ``top_k`` is the number of tokens kept (``V`` to disable), ``top_p`` the nucleus mass (1.0 to
    disable). ``filtered`` is static per captured artifact: False skips the sort when no row in
    the batch restricts top-k / top-p. ``greedy_only`` (static) skips the noise when every row
    is greedy; the result is the same argmax either way.
    """
    greedy = logits.argmax(dim=-1)
    if greedy_only:
        return greedy
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / temp[:, None]
    noise = gumbel_noise(seeds, out_pos, tok_hash)
    if filtered:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=logits.device)
        in_top_k = rank[None, :] < top_k[:, None]
        # Top-k first, then the nucleus over the renormalised top-k (as HF / vLLM do).
        probs = torch.where(in_top_k, sorted_logits, -torch.inf).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep = in_top_k & (mass_before < top_p[:, None])
        keep[:, 0] = True
        perturbed = torch.where(keep, sorted_logits + noise.gather(1, order), -torch.inf)
        sampled = order.gather(1, perturbed.argmax(dim=-1, keepdim=True)).squeeze(1)
    else:
        sampled = (scaled + noise).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)
