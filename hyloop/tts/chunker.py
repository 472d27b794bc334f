"""A TTS request's engine outputs -> its ``FrameChunk``\\ s (and, inline, their audio).

A request's first chunk holds ``initial_chunk_frames`` frames, later ones ``chunk_frames``, its
last one the rest (maybe none) with ``final=True``. The end frame that stops a request is not
audio and is not part of any chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hyloop.framework.outputs import RequestOutput
from hyloop.tts.codec import Codec
from hyloop.tts.metrics import FrameChunk, RequestTimer, TTSMetrics
from hyloop.tts.params import TTSParams


@dataclass
class RequestState:
    params: TTSParams
    timer: RequestTimer
    pending: list[list[int]] = field(default_factory=list)  # frames not in a chunk yet
    chunks: int = 0
    context: np.ndarray | None = None  # the inline codec's left context
    cached: int = 0


def chunk_output(
    req: RequestState, out: RequestOutput, channels: int, end_id: int
) -> Iterator[FrameChunk]:
    req.cached = out.num_cached_tokens
    sample = out.outputs[0]
    new = sample.rows or []
    if out.finished and new and new[-1][0] == end_id:
        new = new[:-1]  # the end frame: not audio
    req.pending.extend(new)
    p = req.params
    rid = out.request_id
    while True:
        size = p.initial_chunk_frames if req.chunks == 0 else p.chunk_frames
        if len(req.pending) < size or (out.finished and len(req.pending) == size):
            break  # not full yet, or the last chunk (which carries ``final``)
        yield _take(rid, req, size, channels, final=False, reason=None)
    if out.finished:
        last = _take(rid, req, len(req.pending), channels, True, sample.finish_reason)
        last.error = getattr(sample, "error", None)
        yield last


def _take(
    rid: str, req: RequestState, n: int, channels: int, final: bool, reason: str | None
) -> FrameChunk:
    rows = np.asarray(req.pending[:n], dtype=np.int64).reshape(n, channels)
    del req.pending[:n]
    req.chunks += 1
    return FrameChunk(rid, rows, final, reason, num_cached_rows=req.cached)


def decode_inline(codec: Codec, req: RequestState, chunk: FrameChunk) -> None:
    """Decode ``chunk``'s audio on the caller's thread with the request's left context."""
    codes = chunk.rows[:, 1:]
    context = req.context if req.context is not None else codes[:0]
    chunk.audio = np.asarray(codec.decode(codes, context), dtype=np.float32)
    chunk.sample_rate = codec.sample_rate
    k = codec.context_frames
    req.context = np.concatenate([context, codes])[-k:] if k else codes[:0]


@dataclass
class TTSOutput:
    request_id: str
    rows: np.ndarray  # [n, channels] int64, the end frame excluded
    finish_reason: str | None
    num_cached_rows: int
    audio: np.ndarray | None = None  # float32 PCM of every frame (with a codec)
    sample_rate: int | None = None
    metrics: TTSMetrics | None = None
    error: str | None = None


def join_chunks(rid: str, chunks: list[FrameChunk], codec: Codec | None) -> TTSOutput:
    """A finished request's chunks as one ``TTSOutput`` (its audio joined, with a codec)."""
    if not chunks or not chunks[-1].final:
        raise RuntimeError(f"request {rid!r}: the engine ran dry before it finished")
    last = chunks[-1]
    audio = None
    if codec is not None:
        parts = [c.audio for c in chunks if c.audio is not None]
        audio = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
    return TTSOutput(
        rid,
        np.concatenate([c.rows for c in chunks]),
        last.finish_reason,
        last.num_cached_rows,
        audio,
        codec.sample_rate if codec else None,
        last.metrics,
        last.error,
    )


def as_rows(rows: Any) -> Any:
    """A numpy array, a tensor or nested lists -> an int64 tensor (checked by the engine)."""
    if isinstance(rows, np.ndarray):
        if not np.issubdtype(rows.dtype, np.integer):
            raise ValueError(f"prompt rows: dtype {rows.dtype}; expected integers")
        return torch.from_numpy(rows.astype(np.int64, copy=False))
    return rows
