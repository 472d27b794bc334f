"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the delta-rule kernels and the layer over a state pool.

Per value head the state ``S [dk, dv]`` (fp32) decays by ``exp(g)`` each token, takes
``beta * (v - S^T k)`` along ``k`` (the delta rule) and is read as ``o = S^T q``. Prefill runs the
chunked (WY) form on a chunk grid fixed from position 0, decode the recurrence; both carry the
state in and out, so a prefill can be split anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

from hyloop.graphs.step_batch import StepBatch
from hyloop.models.layers.conv1d import causal_conv1d, causal_conv1d_step

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """fp32, heads first, q/k L2-normalised, q scaled, k heads repeated to the value heads."""
    num_k_heads, num_v_heads = k.shape[2], v.shape[2]
    if num_v_heads % num_k_heads != 0:
        raise ValueError(f"value heads {num_v_heads} not a multiple of key heads {num_k_heads}")
    # Grouped value heads: key head h serves the r CONSECUTIVE value heads h*r .. h*r+r-1.
    r = num_v_heads // num_k_heads
    q, k = (repeat(t.float(), "b t h d -> b (h r) t d", r=r) for t in (q, k))
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    v = rearrange(v.float(), "b t h d -> b h t d")
    g, beta = (rearrange(t.float(), "b t h -> b h t") for t in (g, beta))
    return q, k, v, g, beta


def _initial_state(
    initial_state: torch.Tensor | None, v: torch.Tensor, head_k_dim: int
) -> torch.Tensor:
    if initial_state is None:
        b, h, _, dv = v.shape
        return v.new_zeros(b, h, head_k_dim, dv)
    return initial_state.float()


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule over raw ``q, k [B, T, Hk, dk]`` (normalised here),
    ``v [B, T, Hv, dv]``, log-decay ``g <= 0`` and ``beta [B, T, Hv]``, from ``initial_state
    [B, Hv, dk, dv]`` (None: zeros). Returns ``o [B, T, Hv, dv]`` in ``v``'s dtype and the final
    state in fp32."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    state = _initial_state(initial_state, v, q.shape[-1])
    outs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    o = torch.stack(outs, dim=1)  # [B, T, Hv, dv]
    return o.to(out_dtype), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule; same arguments and results as the recurrent form.

    Positions with ``beta == 0`` and ``g == 0`` leave the state untouched: that keeps padding (past
    a row's real length, and up to whole chunks) inert.
    """
    out_dtype = v.dtype
    seq_len = q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    state = _initial_state(initial_state, v, q.shape[-1])

    pad = (-seq_len) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    q, k, v = (rearrange(t, "b h (n c) d -> b h n c d", c=chunk_size) for t in (q, k, v))
    g, beta = (rearrange(t, "b h (n c) -> b h n c", c=chunk_size) for t in (g, beta))

    gamma = g.cumsum(-1)  # log-decay from the chunk start through position i
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(gamma_i - gamma_j) for j <= i, else 0 (masked before exp: no overflow).
    decay = torch.where(causal, gamma[..., :, None] - gamma[..., None, :], float("-inf")).exp()

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    # (I + strictly_lower(beta K K^T * decay))^-1 applied by a unit-triangular solve (WY form).
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    k_decayed = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]

    outs = []
    for n in range(q.shape[2]):
        v_new = u[:, :, n] - w[:, :, n] @ state
        outs.append(q_decayed[:, :, n] @ state + intra[:, :, n] @ v_new)
        state = state * chunk_decay[:, :, n] + k_decayed[:, :, n].transpose(-1, -2) @ v_new
    o = rearrange(torch.stack(outs, dim=2), "b h n c d -> b (n c) h d")[:, :seq_len]
    return o.to(out_dtype), state


@dataclass(frozen=True)
class GDNDims:
    """Sizes of one Gated DeltaNet layer, taken from an HF-style config."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    rms_norm_eps: float = 1e-6
    # Qwen3-Next packs q|k|v|z and b|a per key-head group; Qwen3.5 has split projections.
    interleaved_proj: bool = False

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads != 0:
            raise ValueError(
                f"linear_num_value_heads={self.num_v_heads} must be a multiple of "
                f"linear_num_key_heads={self.num_k_heads}"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim={self.conv_kernel}, expected >= 2")

    @classmethod
    def from_config(cls, cfg: dict[str, Any], interleaved_proj: bool = False) -> GDNDims:
        """From an HF config dict (its ``linear_*`` names)."""
        return cls(
            hidden_size=cfg["hidden_size"],
            num_k_heads=cfg["linear_num_key_heads"],
            num_v_heads=cfg["linear_num_value_heads"],
            head_k_dim=cfg["linear_key_head_dim"],
            head_v_dim=cfg["linear_value_head_dim"],
            conv_kernel=cfg["linear_conv_kernel_dim"],
            rms_norm_eps=cfg["rms_norm_eps"],
            interleaved_proj=interleaved_proj,
        )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def temporal_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


class RMSNormGated(nn.Module):
    """Per-head RMSNorm with a plain weight, THEN the SiLU gate (Qwen3-Next order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One GDN layer over its state in the recurrent pool; HF weight names, so checkpoints load
    by name."""

    def __init__(self, dims: GDNDims, layer_idx: int, recurrent_idx: int) -> None:
        super().__init__()
        self.dims = dims
        self.layer_idx = layer_idx
        self.recurrent_idx = recurrent_idx
        d = dims
        if d.interleaved_proj:
            self.in_proj_qkvz = nn.Linear(d.hidden_size, d.conv_dim + d.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(d.hidden_size, 2 * d.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(d.hidden_size, d.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(d.hidden_size, d.value_dim, bias=False)
            self.in_proj_b = nn.Linear(d.hidden_size, d.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(d.hidden_size, d.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            d.conv_dim, d.conv_dim, d.conv_kernel, groups=d.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(d.num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(d.num_v_heads).uniform_(0.01, 16)))
        self.norm = RMSNormGated(d.head_v_dim, d.rms_norm_eps)
        self.out_proj = nn.Linear(d.value_dim, d.hidden_size, bias=False)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [B, T, hidden]`` -> conv input ``[B, T, conv_dim]`` (q|k|v), z, b, a."""
        d = self.dims
        if not d.interleaved_proj:
            z = rearrange(self.in_proj_z(x), "b t (h d) -> b t h d", d=d.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        # Per key-head group g: [q_g (dk) | k_g (dk) | v_g (r*dv) | z_g (r*dv)] and [b_g | a_g].
        r = d.num_v_heads // d.num_k_heads
        qkvz = rearrange(self.in_proj_qkvz(x), "b t (g e) -> b t g e", g=d.num_k_heads)
        q, k, v, z = qkvz.split(
            [d.head_k_dim, d.head_k_dim, r * d.head_v_dim, r * d.head_v_dim], -1
        )
        b, a = rearrange(self.in_proj_ba(x), "b t (g e) -> b t g e", g=d.num_k_heads).split(r, -1)
        qkv = torch.cat([t.flatten(2) for t in (q, k, v)], -1)
        z = rearrange(z, "b t g (r d) -> b t (g r) d", d=d.head_v_dim)
        return qkv, z, b.flatten(2), a.flatten(2)

    def forward_states(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor,
        temporal_state: torch.Tensor,
        extend_lens: torch.Tensor,
        is_decode: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pure step over explicit states -> ``(out [B, T, hidden], new conv, new temporal)``.
        Row ``b`` of ``x`` has ``extend_lens[b]`` real tokens, left-aligned (padding leaves both
        states untouched); ``is_decode`` (static) selects the single-token recurrence."""
        d = self.dims
        qkv, z, b, a = self._project(x)
        weight = self.conv1d.weight.squeeze(1)
        if is_decode:
            y, new_conv = causal_conv1d_step(qkv[:, 0], conv_state, weight)
            y = y.unsqueeze(1)
        else:
            y, new_conv = causal_conv1d(qkv, conv_state, weight, extend_lens)
        q, k, v = y.split([d.key_dim, d.key_dim, d.value_dim], -1)
        q, k = (rearrange(t, "b t (h d) -> b t h d", d=d.head_k_dim) for t in (q, k))
        v = rearrange(v, "b t (h d) -> b t h d", d=d.head_v_dim)

        # Gates in fp32: in half precision -exp(A_log) * softplus(...) can reach -inf.
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if is_decode:
            o, new_temporal = recurrent_gated_delta_rule(q, k, v, g, beta, temporal_state)
        else:
            # NOTE: beta = g = 0 past the real length is what keeps padding out of the state.
            steps = torch.arange(x.shape[1], device=x.device)
            real = (steps[None, :] < extend_lens[:, None])[..., None]
            beta = torch.where(real, beta, 0.0)
            g = torch.where(real, g, 0.0)
            o, new_temporal = chunk_gated_delta_rule(q, k, v, g, beta, temporal_state)
        o = self.norm(o, z)
        return self.out_proj(rearrange(o, "b t h d -> b t (h d)")), new_conv, new_temporal

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        pool = batch.pools.recurrent
        if pool is None:
            raise ValueError(f"GDN layer {self.layer_idx}: the step has no recurrent pool")
        slots = batch.state_slots
        conv_buf = pool.conv[self.recurrent_idx]
        temporal_buf = pool.temporal[self.recurrent_idx]
        out, new_conv, new_temporal = self.forward_states(
            x,
            conv_buf.index_select(0, slots),
            temporal_buf.index_select(0, slots),
            batch.extend_lens,
            batch.is_decode,
        )
        # In place on the pool buffers: a captured step keeps writing the same storage.
        conv_buf.index_copy_(0, slots, new_conv.to(conv_buf.dtype))
        temporal_buf.index_copy_(0, slots, new_temporal.to(temporal_buf.dtype))
        return out
