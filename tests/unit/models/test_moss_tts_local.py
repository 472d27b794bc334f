"""MOSS-TTS-Local against an independent reference on tiny random checkpoints.

The reference is transformers' ``Qwen3Model`` over summed channel embeddings (the whole sequence
each frame, no cache) plus the local transformer written out plainly here: the growing local
sequence recomputed from scratch each micro-step, RoPE as complex rotations of (2i, 2i+1) pairs.
It reads the codebook tables as sglang-omni does: rows at or past ``audio_vocab_size`` (the pad
row of the released layout) zeroed after loading, every channel's lookup summed, code logits
over the first ``audio_vocab_size`` rows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    TINY_MOSS_LOCAL,
    make_batch,
    moss_local_tensors,
    tiny_moss_local_config,
    write_moss_local_checkpoint,
)
from safetensors.torch import load_file

from hyloop.framework.step_kinds import candidate_cap
from hyloop.framework.token_step import last_rows
from hyloop.graphs.safety import check_capture_safe
from hyloop.graphs.sampler import sample, token_hashes
from hyloop.models.arch.moss_tts_local import FrameOutput, FrameSampling, MossTTSLocalLM
from hyloop.models.loader import load_model
from hyloop.models.weights import WeightLoadError
from hyloop.pools import KVPool, ReqToTokenPool

MAX_CTX = 64
FRAMES = 12
CPU = torch.device("cpu")


def load(path: Path) -> MossTTSLocalLM:
    model = load_model(path, torch.float32, CPU).model
    assert isinstance(model, MossTTSLocalLM)
    return model


# ---------------------------------------------------------------------------------------------
# The independent reference.


class Reference:
    def __init__(self, path: Path) -> None:
        import transformers

        self.cfg: dict[str, Any] = json.loads((path / "config.json").read_text())
        self.w = load_file(str(path / "model.safetensors"))
        lang = {
            k: v
            for k, v in self.cfg["language_config"].items()
            if k not in ("model_type", "architectures")
        }
        qcfg = transformers.Qwen3Config(**lang)
        qcfg._attn_implementation = "eager"
        self.backbone = transformers.Qwen3Model(qcfg).eval()
        body = {
            k.removeprefix("transformer."): v
            for k, v in self.w.items()
            if k.startswith("transformer.")
        }
        self.backbone.load_state_dict(body, strict=True)
        self.n_vq = self.cfg["n_vq"]
        self.vocab = self.cfg["audio_vocab_size"]
        pad = self.cfg["audio_pad_code"]
        for c in range(self.n_vq):
            name = f"audio_embeddings.{c}.weight"
            table = self.w[name]
            if len(table) <= pad:  # the compact layout: the pad row is implicit
                table = torch.cat([table, table.new_zeros(pad + 1 - len(table), table.shape[1])])
            table[self.vocab :] = 0.0  # the pad row(s)
            self.w[name] = table
        g = self.cfg["gpt2_config"]
        self.heads, self.base, self.eps = g["n_head"], g["rope_base"], g["layer_norm_epsilon"]

    def embed(self, rows: torch.Tensor) -> torch.Tensor:
        x = self.w["transformer.embed_tokens.weight"][rows[:, 0]]
        for c in range(self.n_vq):
            x = x + self.w[f"audio_embeddings.{c}.weight"][rows[:, c + 1]]
        return x

    @torch.no_grad()
    def last_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        out = self.backbone(inputs_embeds=self.embed(rows)[None])
        return out.last_hidden_state[0, -1]

    def local(self, seq: list[torch.Tensor]) -> torch.Tensor:
        """The local transformer over the whole local sequence; the last position's output."""
        x = torch.stack(seq)  # [L, H]
        n, hidden = x.shape
        hd = hidden // self.heads
        theta = self.base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angle = torch.arange(n, dtype=torch.float64)[:, None] * theta[None]
        turn = torch.polar(torch.ones_like(angle), angle).to(torch.complex64)  # [L, hd/2]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, self.heads, hd).transpose(0, 1)  # [nh, L, hd]

        def rope(t: torch.Tensor) -> torch.Tensor:
            pairs = torch.view_as_complex(t.reshape(self.heads, n, hd // 2, 2).contiguous())
            return torch.view_as_real(pairs * turn).reshape(self.heads, n, hd)

        def ln(t: torch.Tensor, name: str) -> torch.Tensor:
            w, b = self.w[name + ".weight"], self.w[name + ".bias"]
            return F.layer_norm(t, (hidden,), w, b, self.eps)

        def linear(t: torch.Tensor, name: str) -> torch.Tensor:
            return t @ self.w[name + ".weight"].T + self.w[name + ".bias"]

        future = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        for i in range(self.cfg["local_transformer_layers"]):
            p = f"local_transformer.h.{i}."
            q, k, v = linear(ln(x, p + "ln_1"), p + "attn.c_attn").split(hidden, dim=-1)
            q, k, v = rope(heads(q)), rope(heads(k)), heads(v)
            scores = (q @ k.transpose(1, 2) / math.sqrt(hd)).masked_fill(future, -math.inf)
            attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, hidden)
            x = x + linear(attn, p + "attn.c_proj")
            x = x + linear(F.silu(linear(ln(x, p + "ln_2"), p + "mlp.fc_in")), p + "mlp.fc_out")
        return ln(x, "local_transformer.ln_f")[-1]

    @torch.no_grad()
    def greedy_frame(
        self, h: torch.Tensor
    ) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
        """(row, codes, stop logits [2], code logits [n_vq, V]) of one greedy frame."""
        seq = [h]
        out = self.local(seq)
        stop_logits = out @ self.w["local_text_lm_head.weight"].T
        stop = int(stop_logits.argmax())
        codes, code_logits = [], []
        for c in range(self.n_vq):
            table = self.w[f"audio_embeddings.{c}.weight"][: self.vocab]
            logits = out @ table.T
            code = int(logits.argmax())
            codes.append(code)
            code_logits.append(logits)
            seq.append(table[code])
            out = self.local(seq)
        cfg = self.cfg
        if stop:
            row = [cfg["audio_end_token_id"]] + [cfg["audio_pad_code"]] * self.n_vq
        else:
            row = [cfg["audio_assistant_slot_token_id"], *codes]
        return row, codes, stop_logits, torch.stack(code_logits)


# ---------------------------------------------------------------------------------------------
# Driving hyloop's model through paged steps.


class Runner:
    """Padded batched steps over a KV pool with a fixed slot per (request, position)."""

    def __init__(self, model: MossTTSLocalLM, num_requests: int) -> None:
        self.model = model
        self.kv = KVPool(
            len(model.contract.kv_windows), 1 + num_requests * MAX_CTX, 1, model.contract.kv_heads,
            model.contract.head_dim,
            torch.float32, "cpu",
        )  # fmt: skip
        self.table = ReqToTokenPool(num_requests, MAX_CTX, "cpu")
        for r in range(num_requests):
            self.table.table[r] = 1 + r * MAX_CTX + torch.arange(MAX_CTX, dtype=torch.int32)

    @torch.no_grad()
    def step(self, starts: list[int], rows: list[torch.Tensor]) -> torch.Tensor:
        """Request ``r`` appends ``rows[r] [n, C]`` at ``starts[r]``; returns last hidden [B, H]."""
        b, t, c = len(rows), max(len(r) for r in rows), self.model.num_channels
        ids = torch.zeros(b, t, c, dtype=torch.int64)
        pos, loc = torch.zeros(b, t, dtype=torch.int64), torch.zeros(b, t, dtype=torch.int64)
        for r, (start, new) in enumerate(zip(starts, rows, strict=True)):
            n = len(new)
            ids[r, :n] = new
            pos[r] = torch.arange(start, start + t)
            loc[r, :n] = self.table.table[r, start : start + n].long()
        lens = torch.tensor([len(r) for r in rows])
        ctx = make_batch(
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            req_rows=torch.arange(b),
            prefix_lens=torch.tensor(starts),
            extend_lens=lens,
            req_to_token=self.table.table,
            kv_len=max(s + len(r) for s, r in zip(starts, rows, strict=True)),
            kv=self.kv,
            is_decode=t == 1,
        )
        hidden = self.model(ctx)
        return last_rows(hidden, ctx)


def sampling(
    b: int,
    n_vq: int,
    vocab: int,
    *,
    temp: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    penalty: float = 1.0,
    history: torch.Tensor | None = None,
    frame: int = 0,
    seeds: torch.Tensor | None = None,
    greedy_only: bool = False,
) -> FrameSampling:
    k = vocab if top_k is None else top_k
    return FrameSampling(
        text_temperature=torch.full((b,), temp),
        text_top_k=torch.full((b,), 2),
        text_top_p=torch.full((b,), top_p),
        audio_temperature=torch.full((b,), temp),
        audio_top_k=torch.full((b,), k),
        audio_top_p=torch.full((b,), top_p),
        audio_repetition_penalty=torch.full((b,), penalty),
        history=torch.full((b, 4, n_vq), -1) if history is None else history,
        seeds=torch.arange(b) * 7919 + 11 if seeds is None else seeds,
        frame_pos=torch.full((b,), frame),
        audio_top_cap=candidate_cap([(temp, -1 if top_k is None else top_k, top_p)], vocab),
        greedy_only=greedy_only,
    )


def prompt(n: int, model: MossTTSLocalLM, gen: torch.Generator) -> torch.Tensor:
    """Text rows (pad codes) followed by a few reference-audio rows (slot id + codes)."""
    rows = torch.full((n, model.num_channels), model.pad_code)
    rows[:, 0] = torch.randint(3, 240, (n,), generator=gen)
    audio = n // 2
    rows[-audio:, 0] = model.slot_id
    rows[-audio:, 1:] = torch.randint(0, model.audio_vocab_size, (audio, model.n_vq), generator=gen)
    return rows


@pytest.fixture(scope="module")
def compact_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hyloop's earlier layout: codebook tables of ``audio_vocab_size`` rows."""
    cfg = tiny_moss_local_config(*TINY_MOSS_LOCAL["nvq3_v16_l1"])
    tensors = moss_local_tensors(cfg, seed=3, layout="compact")
    return write_moss_local_checkpoint(tmp_path_factory.mktemp("compact") / "ckpt", cfg, tensors)


@pytest.fixture(scope="module", params=[*sorted(TINY_MOSS_LOCAL), "compact"])
def ckpt(
    request: pytest.FixtureRequest, moss_local_ckpts: dict[str, Path], compact_ckpt: Path
) -> Path:
    """The released layout (pad rows present, not zero) at two shapes, and the compact one."""
    return compact_ckpt if request.param == "compact" else moss_local_ckpts[request.param]


# ---------------------------------------------------------------------------------------------
# 1. Greedy frames equal the reference.


def test_greedy_frames_match_reference(ckpt: Path) -> None:
    model, ref = load(ckpt), Reference(ckpt)
    gen = torch.Generator().manual_seed(5)
    prompts = [prompt(10, model, gen), prompt(7, model, gen)]
    runner = Runner(model, len(prompts))
    tok_hash = token_hashes(model.contract.vocab_size, "cpu")
    seqs = [p.clone() for p in prompts]
    last = runner.step([0, 0], prompts)
    stops = [0, 0]  # continuing, stopping frames seen
    for frame in range(FRAMES):
        s = sampling(2, model.n_vq, model.audio_vocab_size, frame=frame)
        with torch.no_grad():
            out = model.decode_frame(last, s, tok_hash, keep_logits=True)
        assert out.logits is not None
        for r, seq in enumerate(seqs):
            h = ref.last_hidden(seq)
            torch.testing.assert_close(last[r], h, atol=1e-4, rtol=0)
            row, codes, stop_logits, code_logits = ref.greedy_frame(h)
            assert out.rows[r].tolist() == row, f"frame {frame}, request {r}"
            assert out.codes[r].tolist() == codes, f"frame {frame}, request {r}"
            assert bool(out.stop[r]) == (row[0] == model.end_id)
            torch.testing.assert_close(out.logits[0][r], stop_logits, atol=1e-4, rtol=0)
            torch.testing.assert_close(out.logits[1][r], code_logits, atol=1e-4, rtol=0)
            stops[int(out.stop[r])] += 1
        # Keep decoding through a stop (as ignore_stop would): feed the continuing row.
        fed = torch.cat([torch.full((2, 1), model.slot_id), out.codes], dim=1)
        starts = [len(s) for s in seqs]
        seqs = [torch.cat([seq, fed[r : r + 1]]) for r, seq in enumerate(seqs)]
        last = runner.step(starts, [fed[0:1], fed[1:2]])
    assert out.rows.dtype == torch.int64 and out.codes.shape == (2, model.n_vq)
    assert min(stops) > 0  # both row kinds were built and compared


# ---------------------------------------------------------------------------------------------
# 2. Loading.


def variant(
    tmp_path: Path,
    edit_config: Any = None,
    edit_tensors: Any = None,
    shape: tuple[int, int, int] = (3, 16, 1),
) -> Path:
    cfg = tiny_moss_local_config(*shape)
    tensors = moss_local_tensors(cfg, seed=1)
    if edit_config is not None:
        edit_config(cfg)
    if edit_tensors is not None:
        edit_tensors(tensors)
    return write_moss_local_checkpoint(tmp_path / "ckpt", cfg, tensors)


def test_table_rows_past_the_codes_are_dropped(tmp_path: Path) -> None:
    """A table of 17 (released) or more rows loads as its first 16; the rest never matter."""

    def wide(t: dict[str, torch.Tensor]) -> None:
        t["audio_embeddings.1.weight"] = torch.cat([t["audio_embeddings.1.weight"][:16]] * 2)

    cfg = tiny_moss_local_config(3, 16, 1)
    released = moss_local_tensors(cfg, seed=1)
    assert released["audio_embeddings.0.weight"].shape == (17, 64)
    assert released["audio_embeddings.0.weight"][16].abs().sum() > 0  # a non-zero pad row
    model = load(variant(tmp_path, edit_tensors=wide))
    for c, table in enumerate(model.audio_embeddings):
        torch.testing.assert_close(table.weight, released[f"audio_embeddings.{c}.weight"][:16])
        assert model.audio_heads[c].weight is table.weight  # the head stays tied


def test_released_layout_loads_and_ignores_the_unused_heads(tmp_path: Path) -> None:
    def break_heads(t: dict[str, torch.Tensor]) -> None:
        t["text_lm_head.weight"] = torch.zeros(3, 5)  # any shape: never read
        t["audio_lm_heads.0.weight"] = torch.zeros(7)
        t["audio_lm_heads.9.weight"] = torch.zeros(2, 2)

    model = load(variant(tmp_path, edit_tensors=break_heads))
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.startswith(("text_lm_head", "audio_lm_heads")) for n in names)
    assert model.contract.rows is not None
    assert model.contract.rows.channel_vocab_sizes == (256, 17, 17, 17)
    assert (model.num_channels, model.n_vq, model.end_id, model.slot_id) == (4, 3, 251, 250)
    assert (model.pad_code, model.audio_vocab_size, model.contract.vocab_size) == (16, 16, 16)
    c = model.contract
    assert (len(c.kv_windows), c.kv_heads, c.head_dim) == (2, 1, 32)
    assert (model.spec.max_positions, model.spec.vocab_size, model.hidden_size) == (2048, 256, 64)


def test_model_prefix_and_transformer_alias_load_the_same(tmp_path: Path) -> None:
    def rename(t: dict[str, torch.Tensor]) -> None:
        for k in [k for k in t if k.startswith("transformer.")]:
            t["model." + k.removeprefix("transformer.")] = t.pop(k)

    a = load(variant(tmp_path / "a"))
    b = load(variant(tmp_path / "b", edit_tensors=rename))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_qwen3_config_key_and_any_architectures_name(tmp_path: Path) -> None:
    def edit(cfg: dict[str, Any]) -> None:
        cfg["qwen3_config"] = cfg.pop("language_config")
        cfg["architectures"] = ["SomethingElseEntirely"]
        del cfg["vocab_size_list"], cfg["channels"]

    model = load(variant(tmp_path, edit_config=edit))
    assert model.spec.qk_norm and model.spec.num_layers == 2


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda t: t.update({"local_transformer.h.0.attn.bogus.weight": torch.zeros(2)}),
         "unexpected tensors: local_transformer.h.0.attn.bogus.weight"),
        (lambda t: t.update({"audio_embeddings.3.weight": torch.zeros(16, 64)}),
         "unexpected tensors: audio_embeddings.3.weight"),
        (lambda t: t.pop("local_transformer.ln_f.bias"),
         "missing tensors: local_transformer.ln_f.bias"),
        (lambda t: t.pop("audio_embeddings.1.weight"),
         "missing tensors: audio_embeddings.1.weight"),
        (lambda t: t.pop("transformer.layers.1.self_attn.q_norm.weight"),
         "missing tensors: model.layers.1.self_attn.q_norm.weight"),
        (lambda t: t.update({"audio_embeddings.0.weight": torch.zeros(15, 64)}),
         "audio_embeddings.0.weight: (15, 64), expected (16, 64)$"),
        (lambda t: t.update({"audio_embeddings.2.weight": torch.zeros(17, 32)}),
         "audio_embeddings.2.weight: (16, 32), expected (16, 64)$"),
    ],
)  # fmt: skip
def test_loading_is_strict(tmp_path: Path, edit: Any, named: str) -> None:
    with pytest.raises(WeightLoadError, match=named.replace("(", r"\(").replace(")", r"\)")):
        load(variant(tmp_path, edit_tensors=edit))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("channels", 7, "channels=7, expected n_vq \\+ 1 = 4"),
        ("audio_end_token_id", 999, "audio_end_token_id=999 outside the text vocab"),
        ("audio_pad_code", 3, "audio_pad_code=3"),
        ("vocab_size_list", [256, 16, 16, 16], "vocab_size_list"),
        ("hidden_size", 32, "hidden_size=32"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, key: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load(variant(tmp_path, edit_config=lambda cfg: cfg.update({key: value})))


def test_pad_codes_embed_to_zero(ckpt: Path) -> None:
    model = load(ckpt)
    text = torch.tensor([5, 250, 17])
    rows = torch.full((3, model.num_channels), model.pad_code)
    rows[:, 0] = text
    with torch.no_grad():
        torch.testing.assert_close(
            model.embed_rows(rows), model.model.embed_tokens(text), rtol=0, atol=0
        )
        # One real code adds exactly its table row; the pads beside it add nothing.
        rows[1, 2] = 3
        expect = model.model.embed_tokens(text[1]) + model.audio_embeddings[1].weight[3]
        torch.testing.assert_close(model.embed_rows(rows)[1], expect, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# 3. Sampling: penalty, batch independence, capture safety, compile == eager.


def test_repetition_penalty_matches_transformers(ckpt: Path) -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    model = load(ckpt)
    b, v = 3, model.audio_vocab_size
    last = torch.randn(b, model.hidden_size, generator=torch.Generator().manual_seed(2))
    tok_hash = token_hashes(model.contract.vocab_size, "cpu")
    history = torch.randint(0, v, (b, 5, model.n_vq), generator=torch.Generator().manual_seed(3))
    history[:, -2:] = -1  # empty slots of a young request
    with torch.no_grad():
        raw = model.decode_frame(last, sampling(b, model.n_vq, v), tok_hash, keep_logits=True)
        s = sampling(b, model.n_vq, v, penalty=1.7, history=history)
        pen = model.decode_frame(last, s, tok_hash, keep_logits=True)
    assert raw.logits is not None and pen.logits is not None
    seen = history[:, :3, 0]  # channel 0 depends only on the frame's input, not on codes
    expect = RepetitionPenaltyLogitsProcessor(1.7)(seen, raw.logits[1][:, 0].clone())
    torch.testing.assert_close(pen.logits[1][:, 0], expect, rtol=0, atol=0)
    assert not torch.equal(pen.logits[1][:, 0], raw.logits[1][:, 0])


def test_seeded_frames_do_not_depend_on_the_batch(ckpt: Path) -> None:
    model = load(ckpt)
    b, v = 4, model.audio_vocab_size
    last = torch.randn(b, model.hidden_size, generator=torch.Generator().manual_seed(4))
    tok_hash = token_hashes(model.contract.vocab_size, "cpu")
    history = torch.randint(-1, v, (b, 4, model.n_vq), generator=torch.Generator().manual_seed(6))
    s = sampling(b, model.n_vq, v, temp=1.5, top_k=8, top_p=0.9, penalty=1.3, history=history)
    s.frame_pos = torch.tensor([0, 3, 9, 3])
    with torch.no_grad():
        batched = model.decode_frame(last, s, tok_hash).rows
        for r in range(b):
            one = FrameSampling(
                **{
                    k: (val[r : r + 1] if isinstance(val, torch.Tensor) else val)
                    for k, val in vars(s).items()
                }
            )
            assert torch.equal(model.decode_frame(last[r : r + 1], one, tok_hash).rows[0],
                               batched[r])  # fmt: skip
        # A different frame position draws different noise.
        s.frame_pos = s.frame_pos + 1
        other = model.decode_frame(last, s, tok_hash).rows
    assert not torch.equal(other, batched)


def frame_inputs(model: MossTTSLocalLM, seeded: bool) -> tuple[torch.Tensor, FrameSampling]:
    b, v = 5, model.audio_vocab_size
    gen = torch.Generator().manual_seed(8)
    last = torch.randn(b, model.hidden_size, generator=gen)
    history = torch.randint(-1, v, (b, 6, model.n_vq), generator=gen)
    s = sampling(b, model.n_vq, v, top_k=v // 2, top_p=0.85, penalty=1.4, history=history)
    s.frame_pos = torch.tensor([0, 1, 5, 17, 2])
    if seeded:  # per-row params; row 2 stays greedy
        s.text_temperature = torch.tensor([1.0, 0.7, 0.0, 1.3, 2.0])
        s.audio_temperature = torch.tensor([1.7, 1.0, 0.0, 0.9, 2.5])
        s.audio_top_k = torch.tensor([v, 4, v, 8, 2])
        s.audio_top_p = torch.tensor([0.8, 1.0, 1.0, 0.5, 0.95])
        s.audio_repetition_penalty = torch.tensor([1.0, 1.2, 1.5, 2.0, 1.1])
    return last, s


def test_decode_frame_is_capture_safe(ckpt: Path) -> None:
    model = load(ckpt)
    tok_hash = token_hashes(model.contract.vocab_size, "cpu")
    for seeded in (False, True):
        last, s = frame_inputs(model, seeded)
        with torch.no_grad():
            out = check_capture_safe(model.decode_frame, last, s, tok_hash, True)
        assert isinstance(out, FrameOutput) and out.rows.shape == (5, model.num_channels)
    s.greedy_only = True
    with torch.no_grad():
        check_capture_safe(model.decode_frame, last, s, tok_hash)


@pytest.mark.slow
def test_compiled_decode_frame_equals_eager(ckpt: Path) -> None:
    model = load(ckpt)
    tok_hash = token_hashes(model.contract.vocab_size, "cpu")
    compiled = torch.compile(model.decode_frame, fullgraph=True, dynamic=False)
    outs = []
    for seeded in (False, True):  # same shapes and flags: one artifact, no recompile
        last, s = frame_inputs(model, seeded)
        stance = "fail_on_recompile" if seeded else "default"
        with torch.no_grad(), torch.compiler.set_stance(stance):
            eager = model.decode_frame(last, s, tok_hash)
            graph = compiled(last, s, tok_hash)
        assert torch.equal(graph.rows, eager.rows), f"seeded={seeded}"
        assert torch.equal(graph.stop, eager.stop) and torch.equal(graph.codes, eager.codes)
        outs.append(eager.rows)
    assert not torch.equal(outs[0], outs[1])  # the seeded rows really sampled


def test_each_channel_samples_at_its_rng_position(ckpt: Path) -> None:
    """Channel ch (0 = stop head, c + 1 = code c) draws at ``frame_pos * C + ch``."""
    model = load(ckpt)
    last, s = frame_inputs(model, seeded=True)
    tok_hash = token_hashes(model.contract.vocab_size, "cpu")
    with torch.no_grad():
        out = model.decode_frame(last, s, tok_hash, keep_logits=True)
    assert out.logits is not None
    base = s.frame_pos * model.num_channels
    text = (s.text_temperature, s.text_top_k, s.text_top_p, s.seeds)
    stop = sample(out.logits[0], *text, base, tok_hash[:2], 2)
    assert torch.equal(out.stop, stop == 1)
    audio = (s.audio_temperature, s.audio_top_k, s.audio_top_p, s.seeds)
    v = model.audio_vocab_size
    for c in range(model.n_vq):
        code = sample(out.logits[1][:, c], *audio, base + c + 1, tok_hash[:v], s.audio_top_cap)
        assert torch.equal(out.codes[:, c], code), f"code {c}"
    ended = out.rows[out.stop]
    assert (ended[:, 0] == model.end_id).all() and (ended[:, 1:] == model.pad_code).all()
    going = out.rows[~out.stop]
    assert (going[:, 0] == model.slot_id).all()
    assert torch.equal(going[:, 1:], out.codes[~out.stop])
