"""Qwen3-Next / Qwen3.5 hybrid models against transformers on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import HYBRID_COMMON, TINY_HYBRID, build_hf_checkpoint, load_hf_model, make_batch

from hyloop.models.arch.qwen3_next import FULL, LINEAR, HybridCausalLM, HybridSpec
from hyloop.models.loader import load_model
from hyloop.models.registry import model_class
from hyloop.pools import KVPool, RecurrentPool, ReqToTokenPool

TINY = TINY_HYBRID
MAX_CTX = 256


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    return {name: build_hf_checkpoint(root / name, cfg, seed=3) for name, cfg in TINY.items()}


class Runner:
    """Drives a hyloop model through padded batched steps with explicit pools."""

    def __init__(self, model: HybridCausalLM, num_requests: int) -> None:
        self.model = model
        c = model.contract
        self.kv = KVPool(
            len(c.kv_windows), 1 + num_requests * MAX_CTX, 1, c.kv_heads, c.head_dim,
            torch.float32, "cpu",
        )  # fmt: skip
        self.table = ReqToTokenPool(num_requests, MAX_CTX, "cpu")
        for r in range(num_requests):  # a fixed slot per (request, position); 0 is the sink
            self.table.table[r] = 1 + r * MAX_CTX + torch.arange(MAX_CTX, dtype=torch.int32)
        r = c.recurrent
        assert r is not None
        self.recurrent = RecurrentPool(
            r.num_layers, num_requests + 1, r.temporal_shape, r.conv_dim, r.conv_kernel
        )
        slots = self.recurrent.alloc(num_requests)
        assert slots is not None
        self.slots = slots.tolist()

    @torch.no_grad()
    def step(
        self, rows: list[tuple[int, int, list[int]] | None], decode: bool
    ) -> list[torch.Tensor]:
        """``rows``: (request, start position, new tokens) or None for a padding row.

        Returns the logits of every real new token, per row.
        """
        t = max(len(r[2]) for r in rows if r is not None)
        b = len(rows)
        ids, pos, loc = (torch.zeros(b, t, dtype=torch.int64) for _ in range(3))
        req_rows, prefix, ext, slots = ([0] * b for _ in range(4))
        for i, row in enumerate(rows):
            if row is None:
                req_rows[i] = self.table.padding_row
                continue
            req, start, toks = row
            n = len(toks)
            ids[i, :n] = torch.tensor(toks)
            pos[i] = torch.arange(start, start + t).clamp_max(MAX_CTX - 1)
            loc[i, :n] = self.table.table[req, start : start + n].long()
            req_rows[i], prefix[i], ext[i], slots[i] = req, start, n, self.slots[req]
        ctx = make_batch(
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            req_rows=torch.tensor(req_rows),
            prefix_lens=torch.tensor(prefix),
            extend_lens=torch.tensor(ext),
            req_to_token=self.table.table,
            kv_len=max(p + e for p, e in zip(prefix, ext, strict=True)),
            kv=self.kv,
            recurrent=self.recurrent,
            state_slots=torch.tensor(slots),
            is_decode=decode,
        )
        hidden = self.model(ctx)
        return [self.model.compute_logits(hidden[i, :e]) for i, e in enumerate(ext)]


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_chunked_prefill_and_decode_match_transformers(ckpts: dict[str, Path], name: str) -> None:
    hf = load_hf_model(ckpts[name])
    loaded = load_model(ckpts[name], torch.float32, torch.device("cpu"))
    model = loaded.model
    assert isinstance(model, HybridCausalLM)
    assert model.contract.recurrent is not None
    assert (len(model.contract.kv_windows), model.contract.recurrent.num_layers) == (2, 2)

    gen = torch.Generator().manual_seed(7)
    steps = 6
    seqs = [torch.randint(3, 256, (n + steps,), generator=gen).tolist() for n in (100, 37)]
    with torch.no_grad():
        expected = [hf(torch.tensor([s])).logits[0] for s in seqs]
    assert expected[0].abs().max() > 1.0  # decisive logits (init 0.1), not a near-zero check

    run = Runner(model, num_requests=2)
    got: list[list[torch.Tensor]] = [[], []]
    # Prefill 70 + 37 in one padded batch, then the rest of request 0 next to a padding row.
    out = run.step([(0, 0, seqs[0][:70]), (1, 0, seqs[1][:37])], decode=False)
    got[0].append(out[0])
    got[1].append(out[1])
    out = run.step([(0, 70, seqs[0][70:100]), None], decode=False)
    got[0].append(out[0])
    for i in range(steps):
        rows = [(0, 100 + i, [seqs[0][100 + i]]), (1, 37 + i, [seqs[1][37 + i]]), None]
        out = run.step(rows, decode=True)
        got[0].append(out[0])
        got[1].append(out[1])
    for r in range(2):
        logits = torch.cat(got[r])
        torch.testing.assert_close(logits, expected[r], atol=2e-4, rtol=1e-3)
        assert torch.equal(logits.argmax(-1), expected[r].argmax(-1))


def test_layer_pattern_and_rope_spellings() -> None:
    cfg = {k: v for k, v in TINY["qwen3_next"].items() if k != "layer_types"}
    cfg.update(num_hidden_layers=8, full_attention_interval=4, rope_theta=5e6)
    cfg["partial_rotary_factor"] = 0.25
    spec = HybridSpec.from_hf(cfg, moe=True)
    assert spec.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2
    assert spec.rope.theta == 5e6 and spec.rope.rotary_dim == 8
    assert spec.sparse_layers == (True, True, True, False) + (True,) * 4
    assert spec.gdn.interleaved_proj

    arch = ["Qwen3_5ForConditionalGeneration"]
    nested = {"architectures": arch, "text_config": dict(HYBRID_COMMON)}
    nested["text_config"]["layer_types"] = [LINEAR, FULL, FULL, LINEAR]
    nested["text_config"]["rope_parameters"] = {"rope_theta": 1e7, "partial_rotary_factor": 0.5}
    model_cls = model_class(nested)
    spec = HybridSpec.from_hf(nested, moe=model_cls.moe)
    assert spec.layer_types == (LINEAR, FULL, FULL, LINEAR)
    assert spec.rope.theta == 1e7 and spec.rope.rotary_dim == 16
    assert not any(spec.sparse_layers) and not spec.gdn.interleaved_proj
    model = model_cls(nested)
    assert model.rename_weight("model.language_model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert model.rename_weight("model.visual.blocks.0.attn.qkv.weight") is None

    with pytest.raises(ValueError, match="layer_types"):
        HybridSpec.from_hf(dict(cfg, layer_types=[LINEAR, "sliding_attention"]), moe=True)
