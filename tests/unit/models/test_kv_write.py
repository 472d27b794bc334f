"""Every architecture writes its K/V through the graph-native ``graphs.ops.write_kv``.

Each model runs one padded prefill step with ``write_kv`` wrapped to record its calls. The
check is on the pool itself: after the step, the K/V buffers equal a fresh pool into which only
the recorded ``write_kv`` calls were replayed, so no layer writes the pool any other way.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import TINY_DENSE, TINY_HYBRID, TINY_ROW, make_batch

from hyloop.graphs import ops
from hyloop.graphs.step_batch import StepBatch
from hyloop.models.layers.attention import paged as attention
from hyloop.models.registry import model_class
from hyloop.pools import KVPool, RecurrentPool, ReqToTokenPool

CONFIGS: dict[str, dict[str, Any]] = {**TINY_DENSE, **TINY_HYBRID, "row_lm": TINY_ROW}
MAX_CTX = 16


def prefill_context(model: Any, kv: KVPool, table: ReqToTokenPool) -> StepBatch:
    """Two requests (5 and 3 new tokens, the second padded) and one padding row."""
    lens = [5, 3, 0]
    b, t = len(lens), max(lens)
    rows_layout = model.contract.rows
    channels = rows_layout.channels if rows_layout is not None else None
    shape = (b, t) if channels is None else (b, t, channels)
    ids = torch.randint(3, 32, shape)
    loc = torch.zeros(b, t, dtype=torch.int64)
    rows = torch.tensor([0, 1, table.padding_row])
    for r, n in enumerate(lens[:2]):
        table.table[r] = 1 + r * MAX_CTX + torch.arange(MAX_CTX, dtype=torch.int32)
        loc[r, :n] = table.table[r, :n].long()
    ctx = make_batch(
        input_ids=ids,
        positions=torch.arange(t).repeat(b, 1),
        out_cache_loc=loc,
        req_rows=rows,
        prefix_lens=torch.zeros(b, dtype=torch.int64),
        extend_lens=torch.tensor(lens),
        req_to_token=table.table,
        kv_len=t,
        kv=kv,
    )
    r = model.contract.recurrent
    if r is not None:
        pool = RecurrentPool(r.num_layers, 3, r.temporal_shape, r.conv_dim, r.conv_kernel)
        ctx.pools.recurrent = pool
        slots = pool.alloc(2)
        ctx.state_slots = torch.cat([slots, torch.zeros(1, dtype=torch.int64)])
    return ctx


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_attention_writes_kv_only_through_write_kv(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    cfg = CONFIGS[name]
    model = model_class(cfg)(cfg).eval()
    c = model.contract
    num_kv_layers = len(c.kv_windows)
    pool_args = (num_kv_layers, 1 + 2 * MAX_CTX, 1, c.kv_heads, c.head_dim)
    kv = KVPool(*pool_args, torch.float32, "cpu")
    table = ReqToTokenPool(2, MAX_CTX, "cpu")
    ctx = prefill_context(model, kv, table)

    calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def recording_write_kv(
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        out_cache_loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        layer = next(i for i, buf in enumerate(kv.k) if buf is k_buf)
        assert v_buf is kv.v[layer]
        calls.append((layer, out_cache_loc.clone(), k.detach().clone(), v.detach().clone()))
        ops.write_kv(k_buf, v_buf, out_cache_loc, k, v)

    monkeypatch.setattr(attention, "write_kv", recording_write_kv)
    with torch.no_grad():
        model(ctx)

    assert sorted(layer for layer, *_ in calls) == list(range(num_kv_layers))
    replayed = KVPool(*pool_args, torch.float32, "cpu")
    for layer, loc, k, v in calls:
        assert torch.equal(loc, ctx.out_cache_loc)
        ops.write_kv(replayed.k[layer], replayed.v[layer], loc, k, v)
    for layer in range(num_kv_layers):
        assert torch.equal(kv.k[layer], replayed.k[layer])
        assert torch.equal(kv.v[layer], replayed.v[layer])
        assert kv.k[layer][1:6].abs().sum() > 0  # the real tokens' K/V did land in the pool
