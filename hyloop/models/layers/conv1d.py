"""Short causal depthwise conv1d with a carried state (the conv in front of GDN / Mamba layers).

The state of a row is the last ``K - 1`` RAW inputs (pre-conv, pre-activation), channels first:
``[B, C, K - 1]``. A chunk of new tokens is convolved over ``cat(state, x)`` with no padding, so
a prefill split at any point with the state carried is bit-identical to a one-shot prefill.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange


def _check_shapes(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> None:
    channels, kernel = weight.shape
    if x.shape[-1] != channels:
        raise ValueError(f"conv1d input x: last dim {x.shape[-1]}, expected {channels} channels")
    expected = (x.shape[0], channels, kernel - 1)
    if tuple(state.shape) != expected:
        raise ValueError(f"conv1d state: shape {tuple(state.shape)}, expected {expected}")


def causal_conv1d(
    x: torch.Tensor,
    state: torch.Tensor,
    weight: torch.Tensor,
    extend_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convolve a left-aligned padded chunk ``x [B, T, C]`` that follows ``state [B, C, K-1]``.

    ``weight [C, K]`` is the conv1d weight, group dim squeezed; row ``b`` has ``extend_lens[b]``
    real tokens (all ``T`` when None). Returns ``silu(conv) [B, T, C]`` in ``x``'s dtype (garbage
    past the real length) and, in ``state``'s dtype, the ``K - 1`` raw inputs ending at the real
    length: a row with no real tokens keeps its state.
    """
    _check_shapes(x, state, weight)
    channels, kernel = weight.shape
    seq_len = x.shape[1]
    # The state, then the chunk: position j of x sits at K-1+j of ``padded``.
    padded = torch.cat(
        [state.to(weight.dtype), rearrange(x, "b t c -> b c t").to(weight.dtype)], -1
    )
    y = F.conv1d(padded, weight.unsqueeze(1), groups=channels)  # [B, C, T]
    y = rearrange(F.silu(y), "b c t -> b t c").to(x.dtype)

    if extend_lens is None:
        new_state = padded[..., seq_len:]
    else:
        # NOTE: the state ending at the real length starts at extend_len in ``padded``;
        # a gather keeps shapes static (no per-row slicing, no host sync).
        start = extend_lens.to(torch.int64).view(-1, 1, 1)
        offsets = torch.arange(kernel - 1, device=x.device, dtype=torch.int64).view(1, 1, -1)
        index = (start + offsets).expand(-1, channels, -1)
        new_state = torch.gather(padded, -1, index)
    return y, new_state.to(state.dtype)


def causal_conv1d_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per row: ``x [B, C]`` after ``state [B, C, K-1]``.

    Returns ``(silu(conv) [B, C], new_state)``, the state shifted by one to end at ``x``.
    """
    _check_shapes(x, state, weight)
    padded = torch.cat([state.to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)], -1)  # [B, C, K]
    y = F.silu((padded * weight.unsqueeze(0)).sum(-1))
    return y.to(x.dtype), padded[..., 1:].to(state.dtype)
