"""The frame step kind: one captured step per batch bucket that decodes a whole TTS frame.

``FrameStep.step`` runs the backbone over the rows, then the model's ``decode_frame`` (the local
depth decoder: the stop head and the n_vq code samplers), records the codes in each request's
repetition history, and keys the row (``graphs.ops.row_keys``), all on device. A request's
sampling of the two channel groups and its repetition history live in ``FrameSamplingTable``,
device tables indexed by the step's ``req_rows`` like any request table, so the captured step's
rows stay those of a token step.

Everything about rows lives here: a frame kind's inputs are rows ``[C]``, its sampled "token"
is the row's radix key and the row itself travels as ``StepOutput.next_rows``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from hyloop.framework.requests import Chunk, Request
from hyloop.framework.sampling_params import FrameSamplingParams, SamplingParams
from hyloop.framework.step_kinds import StepKind
from hyloop.framework.token_step import forward_last
from hyloop.graphs.ops import row_keys
from hyloop.graphs.step_batch import GREEDY, RequestTable, StepBatch, StepOutput, column
from hyloop.models.arch.moss_tts_local import FrameSampling

HISTORY_FRAMES = 64  # frames of repetition history kept per request (its window may be shorter)
_DEFAULTS = FrameSamplingParams()


def _frame(attr: str) -> Any:
    return lambda r: getattr(r.params.frame or _DEFAULTS, attr)


@dataclasses.dataclass
class FrameSamplingTable(RequestTable):
    """Per-request frame sampling (``SamplingParams.frame``) and the repetition history the step
    keeps itself (``codes`` of the last frames, ``frames`` their indices; -1 = empty)."""

    text_temperature: torch.Tensor = column(torch.float32, 0.0, _frame("text_temperature"))
    text_top_p: torch.Tensor = column(torch.float32, 1.0, _frame("text_top_p"))
    text_top_k: torch.Tensor = column(torch.int64, -1, _frame("text_top_k"))
    audio_temperature: torch.Tensor = column(torch.float32, 0.0, _frame("audio_temperature"))
    audio_top_p: torch.Tensor = column(torch.float32, 1.0, _frame("audio_top_p"))
    audio_top_k: torch.Tensor = column(torch.int64, -1, _frame("audio_top_k"))
    penalty: torch.Tensor = column(torch.float32, 1.0, _frame("audio_repetition_penalty"))
    window: torch.Tensor = column(
        torch.int64,
        1,
        lambda r: min((r.params.frame or _DEFAULTS).repetition_window, HISTORY_FRAMES),
    )
    ignore_stop: torch.Tensor = column(torch.int64, 0, lambda r: int(r.params.ignore_eos))
    seed: torch.Tensor = column(torch.int64, 0, lambda r: r.seed64)
    codes: torch.Tensor = column(torch.int64, -1, shape=(HISTORY_FRAMES, "n_vq"))
    frames: torch.Tensor = column(torch.int64, -1, shape=(HISTORY_FRAMES,))


class FrameStep(StepKind):
    """A step kind whose step decodes a frame (the model has ``decode_frame``)."""

    table: ClassVar[type[RequestTable]] = FrameSamplingTable
    # The local depth decoder runs n_vq + 1 small sequential positions a frame: hundreds of small
    # kernels, whose calls inductor's C++ wrapper makes directly (bench/tts_frames.py).
    cpu_compile_options: ClassVar[dict[str, Any]] = {"cpp_wrapper": True}

    def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, *args, n_vq=model.n_vq, **kwargs)
        rows = model.contract.rows
        self.row_shape = (rows.channels,)
        self.end_id = rows.end_id

    def filter_group(self, params: SamplingParams) -> tuple[float, int, float]:
        """The audio codes size the sampler (``step_kinds.candidate_cap``); the two-way stop head
        samples over both candidates whatever the row asks."""
        f = params.frame or _DEFAULTS
        return (f.audio_temperature, f.audio_top_k, f.audio_top_p)

    def samples(self, params: SamplingParams) -> bool:
        f = params.frame or _DEFAULTS
        return f.text_temperature > 0 or f.audio_temperature > 0

    def last_rows(self, chunks: list[Chunk]) -> torch.Tensor:
        return torch.tensor([c.req.output_rows[-1] for c in chunks], dtype=torch.int64)  # type: ignore[index]

    def prefill_inputs(self, req: Request, start: int, length: int) -> torch.Tensor:
        """Rows ``[length, C]`` of positions ``start .. start + length - 1``."""
        assert req.prompt_rows is not None and req.output_rows is not None
        n = req.prompt_rows.shape[0]
        parts = []
        if start < n:
            parts.append(req.prompt_rows[start : min(n, start + length)])
        if start + length > n:
            lo = max(0, start - n)
            parts.append(torch.tensor(req.output_rows[lo : start + length - n], dtype=torch.int64))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def step(self, batch: StepBatch) -> StepOutput:
        """Backbone + frame decode + history + row key: one capture-safe step."""
        model = self.model
        last = forward_last(model, batch)
        t, rows, pos = batch.pools.requests, batch.req_rows, batch.out_pos
        assert isinstance(t, FrameSamplingTable)
        # A history entry counts while its frame is within the request's window.
        frames = t.frames[rows]
        age = pos[:, None] - frames
        live = (frames >= 0) & (age > 0) & (age <= t.window[rows][:, None])
        sampling = FrameSampling(
            text_temperature=t.text_temperature[rows],
            text_top_k=t.text_top_k[rows],
            text_top_p=t.text_top_p[rows],
            audio_temperature=t.audio_temperature[rows],
            audio_top_k=t.audio_top_k[rows],
            audio_top_p=t.audio_top_p[rows],
            audio_repetition_penalty=t.penalty[rows],
            history=torch.where(live[..., None], t.codes[rows], -1),
            seeds=t.seed[rows],
            frame_pos=pos,
            audio_top_cap=batch.top_cap,
            greedy_only=bool(batch.features & GREEDY),
            compute=batch.pools.compute,
        )
        out = model.decode_frame(last, sampling, self.tok_hash, batch.keep_logits)
        # Ring write of the sampled codes (padding rows write the padding row).
        slot = torch.remainder(pos, HISTORY_FRAMES)
        t.codes.index_put_((rows, slot), out.codes)
        t.frames.index_put_((rows, slot), pos)
        # A request that ignores the stop head continues with the codes sampled for the frame.
        ignored = out.stop & (t.ignore_stop[rows] == 1)
        cont = out.codes.new_full((out.codes.shape[0], 1), model.slot_id)
        frames_out = torch.where(ignored[:, None], torch.cat([cont, out.codes], dim=1), out.rows)
        logits = None
        if out.logits is not None:  # [B, 1 + n_vq, V]: the stop logits padded with -inf
            stop, codes = out.logits
            pad = stop.new_full((stop.shape[0], codes.shape[-1] - stop.shape[-1]), -torch.inf)
            logits = torch.cat([torch.cat([stop, pad], dim=-1)[:, None], codes], dim=1)
        return StepOutput(row_keys(frames_out, self.end_id), logits, next_rows=frames_out)
