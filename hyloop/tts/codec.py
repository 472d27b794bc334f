"""Codes -> audio: the ``Codec`` protocol, the stage that runs one off the loop's thread, a tone
codec for tests and benches, and a WAV writer.

A codec decodes a chunk's codes ``[n, n_vq]`` given up to ``context_frames`` earlier frames of
the same request (its left context) into float32 PCM ``[n * samples_per_frame]`` at
``sample_rate``. ``CodecStage`` keeps each request's context and decodes chunks in the order they
were submitted on its own thread, so the engine loop only enqueues.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)


class Codec(Protocol):
    sample_rate: int
    samples_per_frame: int
    context_frames: int

    def decode(self, codes: np.ndarray, context: np.ndarray) -> np.ndarray: ...


class ToneCodec:
    """A deterministic stand-in codec (no learned weights): frame ``t`` sounds a chord whose
    pitches come from its first codebooks, faded in from frame ``t - 1``'s chord, so a frame's
    audio depends on one frame of left context, as a causal decoder's does. Chunked decoding
    with that context equals decoding the whole sequence at once."""

    def __init__(
        self,
        sample_rate: int = 48_000,
        frame_rate: float = 12.5,
        voices: int = 3,
        audio_vocab: int = 1024,
    ) -> None:
        spf = sample_rate / frame_rate
        if spf != int(spf) or spf < 1:
            raise ValueError(f"ToneCodec: sample_rate / frame_rate = {spf}; expected an int >= 1")
        self.sample_rate = sample_rate
        self.samples_per_frame = int(spf)
        self.context_frames = 1
        self.voices = voices
        self.audio_vocab = audio_vocab
        spf = self.samples_per_frame
        self._t = (2.0 * np.pi * np.arange(spf, dtype=np.float32) / sample_rate)[None, :]
        self._fade = (np.arange(spf, dtype=np.float32) / spf)[None, :]

    def _chord(self, codes: np.ndarray) -> np.ndarray:
        """``codes [n, n_vq]`` -> each frame's chord ``[n, samples_per_frame]`` (float32)."""
        k = min(self.voices, codes.shape[1])
        out = np.zeros((len(codes), self.samples_per_frame), dtype=np.float32)
        for c in range(k):
            octaves = 4.0 * codes[:, c : c + 1].astype(np.float32) / self.audio_vocab
            out += np.sin((110.0 * 2.0**octaves).astype(np.float32) * self._t)  # 110-1760 Hz
        return out * np.float32(1.0 / max(k, 1))

    def decode(self, codes: np.ndarray, context: np.ndarray) -> np.ndarray:
        if len(codes) == 0:
            return np.zeros(0, dtype=np.float32)
        now = self._chord(codes)
        prev = np.zeros_like(now)
        if len(codes) > 1:
            prev[1:] = now[:-1]
        if len(context):
            prev[0] = self._chord(context[-1:])[0]
        pcm = prev + (now - prev) * self._fade
        return (np.float32(0.5) * pcm).reshape(-1)


Deliver = Callable[[str, Any, np.ndarray | None, str | None], None]


class CodecStage:
    """One thread that decodes ``(request_id, chunk, codes)`` in submission order and hands each
    chunk with its audio to ``deliver(request_id, chunk, audio, error)``. A request's context
    is dropped after its final chunk. A codec error fails that chunk's audio (``error`` set)
    and never stops the stage."""

    def __init__(self, codec: Codec, deliver: Deliver) -> None:
        self.codec = codec
        self._deliver = deliver
        self._jobs: queue.SimpleQueue[tuple[str, Any, np.ndarray, bool] | None] = (
            queue.SimpleQueue()
        )
        self._context: dict[str, np.ndarray] = {}
        self.decode_s = 0.0  # seconds spent decoding (stats)
        self._thread = threading.Thread(target=self._run, name="hyloop-codec", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, chunk: Any, codes: np.ndarray, final: bool) -> None:
        self._jobs.put((request_id, chunk, codes, final))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            rid, chunk, codes, final = job
            k = self.codec.context_frames
            context = self._context.get(rid, np.zeros((0, codes.shape[1]), dtype=np.int64))
            audio, error = None, None
            t0 = time.perf_counter()
            try:
                audio = np.asarray(self.codec.decode(codes, context), dtype=np.float32)
            except Exception as e:  # noqa: BLE001 - a codec failure is that chunk's error
                log.exception("codec failed on request %r", rid)
                error = f"codec: {type(e).__name__}: {e}"
            self.decode_s += time.perf_counter() - t0
            if final:
                self._context.pop(rid, None)
            elif k:
                self._context[rid] = np.concatenate([context, codes])[-k:]
            self._deliver(rid, chunk, audio, error)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)


def decode_whole(codec: Codec, codes: np.ndarray) -> np.ndarray:
    """A request's audio decoded in one call (no left context)."""
    return np.asarray(codec.decode(codes, codes[:0]), dtype=np.float32)


def write_wav(path: str | Path, pcm: np.ndarray, sample_rate: int) -> None:
    """Mono float32 PCM in [-1, 1] -> a 16-bit PCM ``.wav`` file."""
    pcm16 = (np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as fh:
        fh.setnchannels(1)
        fh.setsampwidth(2)
        fh.setframerate(int(sample_rate))
        fh.writeframes(pcm16.tobytes())
