"""What a TTS request's consumer receives: ``FrameChunk``\\ s, and on the last one its
``TTSMetrics`` (time to first audio, real-time factor)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TTSMetrics:
    """Times are seconds from ``add_request``, taken when a chunk reached the request's stream
    (after its audio was decoded, with a codec). ``rtf``: ``finished_s`` over the audio's
    duration (``num_frames / frame_rate``); below 1 is faster than real time."""

    time_to_first_audio_s: float | None  # the first chunk holding a frame
    finished_s: float
    num_frames: int
    audio_s: float
    rtf: float | None
    max_buffered_chunks: int  # the most chunks that waited for the consumer at once


@dataclass
class FrameChunk:
    request_id: str
    rows: np.ndarray  # [n, channels] int64
    final: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" on the final chunk
    audio: np.ndarray | None = None  # float32 PCM of these frames (with a codec)
    sample_rate: int | None = None  # of ``audio``
    num_cached_rows: int = 0  # prompt rows served from the radix cache
    error: str | None = None  # why the request (or this chunk's audio) failed
    metrics: TTSMetrics | None = None  # on the final chunk


class RequestTimer:
    """One request's clock, from its ``add_request``."""

    def __init__(self, frame_rate: float) -> None:
        self.frame_rate = frame_rate
        self.start = time.perf_counter()
        self.first: float | None = None
        self.end: float | None = None
        self.frames = 0

    def delivered(self, frames: int, final: bool) -> None:
        now = time.perf_counter() - self.start
        if frames and self.first is None:
            self.first = now
        self.frames += frames
        if final:
            self.end = now

    def metrics(self, max_buffered: int) -> TTSMetrics:
        end = self.end if self.end is not None else time.perf_counter() - self.start
        audio_s = self.frames / self.frame_rate
        return TTSMetrics(
            time_to_first_audio_s=self.first,
            finished_s=end,
            num_frames=self.frames,
            audio_s=audio_s,
            rtf=end / audio_s if audio_s > 0 else None,
            max_buffered_chunks=max_buffered,
        )
