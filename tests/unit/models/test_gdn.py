from __future__ import annotations

import pytest
import torch
from conftest import make_batch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf35
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as hfnext
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

from hyloop.graphs.step_batch import StepBatch
from hyloop.models.layers.conv1d import causal_conv1d, causal_conv1d_step
from hyloop.models.layers.gdn import (
    GatedDeltaNet,
    GDNDims,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from hyloop.pools.recurrent_pool import RecurrentPool

TOL = {"atol": 1e-5, "rtol": 1e-5}


def gdn_inputs(
    b: int, t: int, hk: int, hv: int, dk: int = 16, dv: int = 8, harsh: bool = False, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, dk, generator=gen)
    k = torch.randn(b, t, hk, dk, generator=gen)
    v = torch.randn(b, t, hv, dv, generator=gen)
    # Harsh gates reach log-decays near -20 per token, like A_log ~ log(16) with large a.
    g = -torch.rand(b, t, hv, generator=gen) * (20.0 if harsh else 1.0)
    beta = torch.rand(b, t, hv, generator=gen)
    h0 = torch.randn(b, hv, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, h0


# -- kernels against transformers ----------------------------------------------------------------
@pytest.mark.parametrize(("hk", "hv"), [(2, 4), (3, 3)])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 130])
def test_kernels_match_transformers(hk: int, hv: int, t: int) -> None:
    q, k, v, g, beta, h0 = gdn_inputs(2, t, hk, hv)
    kw = {"initial_state": h0, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    ref_o, ref_s = hfnext.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, h0)
    torch.testing.assert_close(o, ref_o, **TOL)
    torch.testing.assert_close(s, ref_s, **TOL)
    ref_o, ref_s = hfnext.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, h0)
    torch.testing.assert_close(o, ref_o, **TOL)
    torch.testing.assert_close(s, ref_s, **TOL)


@pytest.mark.parametrize("harsh", [False, True])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
def test_recurrent_equals_chunked(t: int, harsh: bool) -> None:
    q, k, v, g, beta, h0 = gdn_inputs(2, t, 2, 4, harsh=harsh, seed=t)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, h0)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, h0)
    assert o_c.abs().max() > 0.05  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(o_c, o_r, **TOL)
    torch.testing.assert_close(s_c, s_r, **TOL)


@pytest.mark.parametrize("split", [1, 64, 100, 128])
def test_split_prefill_carries_state(split: int) -> None:
    q, k, v, g, beta, h0 = gdn_inputs(2, 200, 2, 4, seed=split)
    o_all, s_all = chunk_gated_delta_rule(q, k, v, g, beta, h0)
    head = [x[:, :split] for x in (q, k, v, g, beta)]
    tail = [x[:, split:] for x in (q, k, v, g, beta)]
    o1, s1 = chunk_gated_delta_rule(*head, h0)
    o2, s2 = chunk_gated_delta_rule(*tail, s1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o_all, **TOL)
    torch.testing.assert_close(s2, s_all, **TOL)
    if split % 64 == 0:  # same chunk grid on both sides: the states agree exactly
        assert torch.equal(s2, s_all)


def test_chunked_prefill_then_recurrent_decode() -> None:
    q, k, v, g, beta, h0 = gdn_inputs(1, 90, 2, 4, seed=3)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, h0)
    o, s = chunk_gated_delta_rule(*(x[:, :70] for x in (q, k, v, g, beta)), h0)
    outs = [o]
    for i in range(70, 90):
        o, s = recurrent_gated_delta_rule(*(x[:, i : i + 1] for x in (q, k, v, g, beta)), s)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), o_ref, **TOL)
    torch.testing.assert_close(s, s_ref, **TOL)


# -- causal conv1d --------------------------------------------------------------------------------
def conv_inputs(b: int, t: int, c: int = 6, kernel: int = 4) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(b, t, c, generator=gen)
    state = torch.randn(b, c, kernel - 1, generator=gen)
    weight = torch.randn(c, kernel, generator=gen)
    return x, state, weight


def test_conv_matches_transformers_update() -> None:
    x, state, weight = conv_inputs(2, 9)
    ref_state = state.clone()
    ref = hfnext.causal_conv1d_update(x.transpose(1, 2), ref_state, weight, None, "silu")
    y, new_state = causal_conv1d(x, state, weight)
    torch.testing.assert_close(y, ref.transpose(1, 2), **TOL)
    torch.testing.assert_close(new_state, ref_state, **TOL)
    # Single step against the same reference.
    ref_state = state.clone()
    ref = hfnext.causal_conv1d_update(x[:, :1].transpose(1, 2), ref_state, weight, None, "silu")
    y, new_state = causal_conv1d_step(x[:, 0], state, weight)
    torch.testing.assert_close(y, ref[..., 0], **TOL)
    torch.testing.assert_close(new_state, ref_state, **TOL)


def test_conv_from_zero_state_matches_transformers_prefill() -> None:
    x, _, weight = conv_inputs(2, 11)
    ref = hfnext.causal_conv1d_fn(x.transpose(1, 2), weight, None, activation="silu")
    y, new_state = causal_conv1d(x, torch.zeros(2, 6, 3), weight)
    torch.testing.assert_close(y, ref.transpose(1, 2), **TOL)
    assert torch.equal(new_state, x[:, -3:].transpose(1, 2))


@pytest.mark.parametrize("split", [1, 2, 5])
def test_conv_token_by_token_and_split(split: int) -> None:
    x, state, weight = conv_inputs(2, 12)
    y_all, s_all = causal_conv1d(x, state, weight)
    s = state
    steps = []
    for i in range(x.shape[1]):
        y, s = causal_conv1d_step(x[:, i], s, weight)
        steps.append(y)
    torch.testing.assert_close(torch.stack(steps, 1), y_all, **TOL)
    torch.testing.assert_close(s, s_all, **TOL)
    y1, s1 = causal_conv1d(x[:, :split], state, weight)
    y2, s2 = causal_conv1d(x[:, split:], s1, weight)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_all, **TOL)
    assert torch.equal(s2, s_all)  # the state is raw inputs: exact


def test_conv_padded_rows_keep_raw_window_at_real_length() -> None:
    x, state, weight = conv_inputs(3, 6)
    lens = torch.tensor([6, 2, 0])
    y, new_state = causal_conv1d(x, state, weight, lens)
    for b, n in enumerate(lens.tolist()[:2]):
        y_b, s_b = causal_conv1d(x[b : b + 1, :n], state[b : b + 1], weight)
        torch.testing.assert_close(y[b : b + 1, :n], y_b, **TOL)
        assert torch.equal(new_state[b : b + 1], s_b)
    assert torch.equal(new_state[2], state[2])  # a padding row keeps its state


def test_conv_rejects_bad_state_shape() -> None:
    x, state, weight = conv_inputs(2, 4)
    with pytest.raises(ValueError, match=r"conv1d state: shape \(2, 6, 2\), expected \(2, 6, 3\)"):
        causal_conv1d(x, state[..., :2], weight)


# -- the layer against transformers' Qwen3-Next / Qwen3.5 GatedDeltaNet -------------------------
HF_DIMS = {
    "hidden_size": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "num_hidden_layers": 1,
    "layer_types": ["linear_attention"],
}


def layer_pair(interleaved: bool) -> tuple[torch.nn.Module, GatedDeltaNet]:
    """An HF GDN layer with randomised weights and hyloop's layer loaded from its state dict."""
    torch.manual_seed(1 if interleaved else 2)
    if interleaved:
        ref = hfnext.Qwen3NextGatedDeltaNet(Qwen3NextConfig(**HF_DIMS), layer_idx=0)
    else:
        ref = hf35.Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**HF_DIMS), layer_idx=0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name in ("dt_bias", "norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name != "A_log":
                p.copy_(0.2 * torch.randn_like(p))
    layer = GatedDeltaNet(GDNDims.from_config(HF_DIMS, interleaved), layer_idx=0, recurrent_idx=0)
    layer.load_state_dict(ref.state_dict(), strict=True)
    return ref.eval(), layer.eval()


def zero_states(layer: GatedDeltaNet, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = layer.dims
    return torch.zeros(b, d.conv_dim, d.conv_kernel - 1), torch.zeros(b, *d.temporal_shape)


@pytest.mark.parametrize("interleaved", [True, False])
@torch.no_grad()
def test_layer_matches_transformers(interleaved: bool) -> None:
    ref, layer = layer_pair(interleaved)
    x = torch.randn(2, 70, 32)
    out, _, _ = layer.forward_states(x, *zero_states(layer, 2), torch.tensor([70, 70]), False)
    expected = ref(x)
    assert expected.abs().max() > 0.01
    torch.testing.assert_close(out, expected, **TOL)


@torch.no_grad()
def test_padded_rows_equal_unpadded_runs() -> None:
    _, layer = layer_pair(interleaved=True)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 80, 32, generator=gen)
    x[1, 66:] = 1e3  # loud padding: must not leak into row 1's state
    lens = torch.tensor([80, 66, 0])
    conv0 = torch.randn(3, layer.dims.conv_dim, 3, generator=gen)
    temporal0 = torch.randn(3, *layer.dims.temporal_shape, generator=gen) * 0.3
    out, conv, temporal = layer.forward_states(x, conv0, temporal0, lens, False)
    for b, n in enumerate(lens.tolist()[:2]):
        row = slice(b, b + 1)
        out_b, conv_b, temporal_b = layer.forward_states(
            x[row, :n], conv0[row], temporal0[row], torch.tensor([n]), False
        )
        torch.testing.assert_close(out[row, :n], out_b, **TOL)
        torch.testing.assert_close(conv[row], conv_b, **TOL)
        torch.testing.assert_close(temporal[row], temporal_b, **TOL)
    assert torch.equal(conv[2], conv0[2]) and torch.equal(temporal[2], temporal0[2])


def make_ctx(
    x: torch.Tensor, lens: list[int], slots: list[int], pool: RecurrentPool, decode: bool
) -> StepBatch:
    b, t = x.shape[:2]
    zeros = torch.zeros(b, t, dtype=torch.int64)
    return make_batch(
        input_ids=zeros,
        positions=zeros,
        out_cache_loc=zeros,
        req_rows=torch.zeros(b, dtype=torch.int64),
        prefix_lens=torch.zeros(b, dtype=torch.int64),
        extend_lens=torch.tensor(lens),
        req_to_token=torch.zeros(1, 1, dtype=torch.int32),
        kv_len=1,
        recurrent=pool,
        state_slots=torch.tensor(slots),
        is_decode=decode,
    )


@pytest.mark.parametrize("interleaved", [True, False])
@torch.no_grad()
def test_prefill_then_decode_through_the_pool(interleaved: bool) -> None:
    """Padded prefill + decode steps via the step context vs one HF pass over each sequence."""
    ref, layer = layer_pair(interleaved)
    d = layer.dims
    pool = RecurrentPool(1, 4, d.temporal_shape, d.conv_dim, d.conv_kernel)
    slots = pool.alloc(2)
    assert slots is not None
    s0, s1 = slots.tolist()
    untouched = pool.alloc(1)
    assert untouched is not None
    pool.temporal[0][untouched] = 3.0

    lens, steps = [67, 5], 4
    seqs = [torch.randn(1, n + steps, 32) for n in lens]
    expected = [ref(s) for s in seqs]
    x = torch.zeros(3, max(lens), 32)  # third row: a padding row on sink slot 0
    for b, n in enumerate(lens):
        x[b, :n] = seqs[b][0, :n]
    out = layer(x, make_ctx(x, [*lens, 0], [s0, s1, 0], pool, decode=False))
    for b, n in enumerate(lens):
        torch.testing.assert_close(out[b, :n], expected[b][0, :n], **TOL)
    for i in range(steps):
        xd = torch.stack([seqs[0][:, lens[0] + i], seqs[1][:, lens[1] + i], torch.zeros(1, 32)])
        out = layer(xd, make_ctx(xd, [1, 1, 0], [s0, s1, 0], pool, decode=True))
        for b, n in enumerate(lens):
            torch.testing.assert_close(out[b, 0], expected[b][0, n + i], **TOL)
    assert torch.all(pool.temporal[0][untouched] == 3.0)
    assert torch.count_nonzero(pool.conv[0][untouched]) == 0


@torch.no_grad()
def test_bf16_layer_keeps_fp32_recurrence() -> None:
    _, layer = layer_pair(interleaved=False)
    x = torch.randn(2, 20, 32)
    lens = torch.tensor([20, 20])
    out32, _, temporal32 = layer.forward_states(x, *zero_states(layer, 2), lens, False)
    layer_bf16 = layer.to(torch.bfloat16)
    conv0, temporal0 = zero_states(layer_bf16, 2)
    out, conv, temporal = layer_bf16.forward_states(x.bfloat16(), conv0, temporal0, lens, False)
    assert out.dtype == torch.bfloat16 and temporal.dtype == torch.float32
    assert conv.dtype == torch.float32  # the state keeps the pool's dtype
    torch.testing.assert_close(out.float(), out32, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(temporal, temporal32, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(("decode", "t"), [(True, 1), (False, 70)])
@torch.no_grad()
def test_forward_traces_as_one_graph(decode: bool, t: int) -> None:
    """fullgraph=True fails on any graph break: no host sync, no data-dependent shape."""
    _, layer = layer_pair(interleaved=True)
    d = layer.dims
    pool = RecurrentPool(1, 2, d.temporal_shape, d.conv_dim, d.conv_kernel)
    x = torch.randn(2, t, 32)
    ctx = make_ctx(x, [t, max(t - 3, 1)], [1, 2], pool, decode)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend="eager")
    out = compiled(x, ctx)
    state = pool.temporal[0].clone()
    pool.zero_slots(torch.tensor([1, 2]))
    torch.testing.assert_close(out, layer(x, ctx), **TOL)
    torch.testing.assert_close(pool.temporal[0], state, **TOL)
