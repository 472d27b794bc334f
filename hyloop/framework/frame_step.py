"""The frame step kind: one captured step per batch bucket that decodes a whole TTS frame.

``run_frame_step`` runs the backbone over the rows, then the model's ``decode_frame`` (the local
depth decoder: the stop head and the n_vq code samplers), records the codes in each request's
repetition history, and keys the row (``graphs.ops.row_keys``), all on device. Per-request
sampling of the two channel groups and the repetition history live in ``FrameState``: device
tables indexed by the step's ``req_rows``, written once when a request takes its row, so the
captured step reads them like any pool and its static inputs stay those of a token step.

``FrameRunner`` is the token ``ModelRunner`` with this step function: the pipeline and both loops
drive it unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyloop.framework.batch import Batch
from hyloop.framework.model_runner import ModelRunner, PreparedStep
from hyloop.framework.request import Request
from hyloop.framework.sampling_params import FrameSamplingParams, SamplingParams
from hyloop.framework.step_fn import SamplingTensors, StepOutput, forward_last
from hyloop.framework.step_inputs import InputBuilder
from hyloop.graphs.context import StepContext
from hyloop.graphs.ops import row_keys
from hyloop.models.arch.moss_tts_local import FrameSampling

# Frames of repetition history kept per request (a request's window may be shorter).
HISTORY_FRAMES = 64
_DEFAULTS = FrameSamplingParams()


class FrameState:
    """Device tables of ``rows`` request rows (the req->token rows, padding row included)."""

    def __init__(self, rows: int, n_vq: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        # Group params, one row each: [text temp, text top_p, audio temp, audio top_p, penalty]
        # and [text top_k, audio top_k, window, ignore_stop]. The padding row stays greedy and
        # unfiltered.
        self.floats = torch.zeros(rows, 5, **f32)  # type: ignore[arg-type]
        self.floats[:, 1] = self.floats[:, 3] = self.floats[:, 4] = 1.0
        self.ints = torch.zeros(rows, 4, **i64)  # type: ignore[arg-type]
        self.ints[:, 0], self.ints[:, 1], self.ints[:, 2] = 2, vocab, 1
        self.codes = torch.full((rows, HISTORY_FRAMES, n_vq), -1, **i64)  # type: ignore[arg-type]
        self.frames = torch.full((rows, HISTORY_FRAMES), -1, **i64)  # type: ignore[arg-type]
        self._owner: list[Request | None] = [None] * rows

    def take(self, row: int, req: Request) -> None:
        """``req`` now owns ``row``: write its sampling and clear the history (host, once)."""
        if self._owner[row] is req:
            return
        self._owner[row] = req
        p = req.params.frame or _DEFAULTS
        text_k = 2 if p.text_top_k == -1 else min(p.text_top_k, 2)
        audio_k = self.vocab if p.audio_top_k == -1 else min(p.audio_top_k, self.vocab)
        floats = [
            p.text_temperature,
            p.text_top_p,
            p.audio_temperature,
            p.audio_top_p,
            p.audio_repetition_penalty,
        ]
        window = min(p.repetition_window, HISTORY_FRAMES)
        dev = self.floats.device
        self.floats[row] = torch.tensor(floats, dtype=torch.float32).to(dev, non_blocking=True)
        ignore_stop = int(req.params.ignore_eos)
        ints = torch.tensor([text_k, audio_k, window, ignore_stop])
        self.ints[row] = ints.to(dev, non_blocking=True)
        self.codes[row] = -1
        self.frames[row] = -1

    def sampling(self, req_rows: torch.Tensor, st: SamplingTensors) -> dict[str, Any]:
        """The ``FrameSampling`` fields of the step's rows (tensor ops: capture-safe)."""
        f, i = self.floats[req_rows], self.ints[req_rows]
        # A history entry counts while its frame is within the request's window.
        frames = self.frames[req_rows]
        age = st.out_pos[:, None] - frames
        live = (frames >= 0) & (age > 0) & (age <= i[:, 2:3])
        history = torch.where(live[..., None], self.codes[req_rows], -1)
        return dict(
            text_temperature=f[:, 0],
            text_top_p=f[:, 1],
            audio_temperature=f[:, 2],
            audio_top_p=f[:, 3],
            audio_repetition_penalty=f[:, 4],
            text_top_k=i[:, 0],
            audio_top_k=i[:, 1],
            history=history,
            seeds=st.seeds,
            frame_pos=st.out_pos,
            audio_top_cap=st.top_cap,
            greedy_only=st.greedy_only,
        )

    def record(self, req_rows: torch.Tensor, frame_pos: torch.Tensor, codes: torch.Tensor) -> None:
        """Ring write of the sampled codes at ``frame_pos % HISTORY_FRAMES`` (padding rows
        write the padding row)."""
        slot = torch.remainder(frame_pos, HISTORY_FRAMES)
        self.codes.index_put_((req_rows, slot), codes)
        self.frames.index_put_((req_rows, slot), frame_pos)


def run_frame_step(
    model: nn.Module,
    ctx: StepContext,
    st: SamplingTensors,
    state: FrameState,
    tok_hash: torch.Tensor,
    keep_logits: bool = False,
) -> StepOutput:
    """Backbone + frame decode + history + row key: one capture-safe step."""
    last = forward_last(model, ctx)
    sampling = FrameSampling(**state.sampling(ctx.req_rows, st))
    out = model.decode_frame(last, sampling, tok_hash, keep_logits)
    state.record(ctx.req_rows, st.out_pos, out.codes)
    # A request that ignores the stop head continues with the codes sampled for the frame.
    ignored = out.stop & (state.ints[ctx.req_rows, 3] == 1)
    slot = out.codes.new_full((out.codes.shape[0], 1), model.slot_id)
    frames = torch.where(ignored[:, None], torch.cat([slot, out.codes], dim=1), out.rows)
    logits = None
    if out.logits is not None:  # [B, 1 + n_vq, V]: the stop logits padded with -inf
        stop, codes = out.logits
        pad = stop.new_full((stop.shape[0], codes.shape[-1] - stop.shape[-1]), -torch.inf)
        logits = torch.cat([torch.cat([stop, pad], dim=-1)[:, None], codes], dim=1)
    return StepOutput(row_keys(frames, model.end_id), logits, next_rows=frames)


class FrameInputBuilder(InputBuilder):
    """A frame samples from its two channel groups (``SamplingParams.frame``)."""

    @staticmethod
    def filter_group(params: SamplingParams) -> tuple[float, int, float]:
        """The audio codes size the sampler (``sampler.candidate_cap``); the two-way stop head
        samples over both candidates whatever the row asks."""
        f = params.frame or _DEFAULTS
        return (f.audio_temperature, f.audio_top_k, f.audio_top_p)

    @staticmethod
    def samples(params: SamplingParams) -> bool:
        f = params.frame or _DEFAULTS
        return f.text_temperature > 0 or f.audio_temperature > 0


class FrameRunner(ModelRunner):
    """A ``ModelRunner`` whose step decodes a frame (the model has ``decode_frame``)."""

    # The local depth decoder runs n_vq + 1 small sequential positions a frame: a few hundred
    # small kernels and GEMMs, whose calls from inductor's Python wrapper cost ~15% of a
    # batch-8 step on CPU; its C++ wrapper calls them directly. (A token step has far fewer
    # kernels and measured no gain: it keeps the Python wrapper.)
    cpu_compile_options = {"cpp_wrapper": True}
    input_builder = FrameInputBuilder

    def __init__(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, *args, **kwargs)
        rows = self.inputs.req_to_token.max_requests + 1
        self.state = FrameState(rows, model.n_vq, model.audio_vocab_size, self.device)

    def step(self, ctx: StepContext, st: SamplingTensors, keep_logits: bool) -> StepOutput:
        return run_frame_step(self.model, ctx, st, self.state, self.tok_hash, keep_logits)

    def prepare(self, batch: Batch) -> PreparedStep:
        for c in batch.chunks:
            self.state.take(c.req.req_row, c.req)
        return super().prepare(batch)
