"""The TTS front end: frames in, streamed chunks of frames (and audio) out.

``TTSEngine`` assembles a frame model (``model_type: moss_tts_local``) from a config like ``LLM``
does and drives the same engine; a request is a prompt of rows ``[N, channels]`` (text id +
codes). ``stream()`` steps the engine and yields ``FrameChunk``\\ s: a request's first chunk
holds ``initial_chunk_frames`` frames, later ones ``chunk_frames``, its last one the rest (empty
when nothing is left) with ``final=True`` and the finish reason. The end frame that stops a
request is not part of its rows. ``add_request`` and ``abort`` may be called from other threads
while ``stream()`` runs. With a ``codec``, each chunk also carries the audio of its frames.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from hyloop.framework.config import EngineConfig
from hyloop.framework.llm import LLM
from hyloop.framework.outputs import RequestOutput
from hyloop.tts.frame_step import FrameStep
from hyloop.tts.params import TTSParams


@dataclass
class FrameChunk:
    request_id: str
    rows: np.ndarray  # [n, channels] int64
    final: bool
    finish_reason: str | None  # "stop" | "length" | "abort" on the final chunk
    audio: np.ndarray | None = None  # float32 PCM of these frames (with a codec)


@dataclass
class TTSOutput:
    request_id: str
    rows: np.ndarray  # [n, channels] int64, the end frame excluded
    finish_reason: str | None
    num_cached_rows: int


class Codec(Protocol):
    """Codes -> audio. ``decode`` gets a chunk's codes ``[n, n_vq]`` and up to
    ``context_frames`` earlier frames of the same request as left context."""

    context_frames: int

    def decode(self, codes: np.ndarray, context: np.ndarray) -> np.ndarray: ...


@dataclass
class _Stream:
    params: TTSParams
    pending: list[list[int]] = field(default_factory=list)
    chunks: int = 0
    context: np.ndarray | None = None


class TTSEngine:
    """``TTSEngine(model, config=None, overrides=())``: a context manager over one engine."""

    def __init__(
        self,
        model: str | Path,
        config: str | Path | list[str | Path] | EngineConfig | None = None,
        overrides: Sequence[str] = (),
        codec: Codec | None = None,
    ) -> None:
        self.llm = LLM(model=model, config=config, overrides=list(overrides))
        self.engine = self.llm.engine
        if not isinstance(self.engine.kind, FrameStep):
            self.llm.close()
            raise ValueError(f"model {model}: not a frame (TTS) model; use hyloop.LLM for it")
        self.channels = self.engine.derived.row_channels
        self.end_id = self.engine.derived.end_id
        self.codec = codec
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self, rows: Any, params: TTSParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request (any thread); its prompt ``rows`` are ``[N, channels]`` ints."""
        if params is None:
            raise ValueError("params: missing; pass TTSParams(max_frames=...)")
        if not isinstance(params, TTSParams):
            raise ValueError(f"params: got {type(params).__name__}; expected TTSParams")
        params.validate()
        rid = request_id if request_id is not None else f"tts-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request {rid!r}: id already in use")
        self._streams[rid] = _Stream(params)
        try:
            self.engine.add_request(rid, _as_rows(rows), params.sampling())
        except Exception:
            self._streams.pop(rid, None)
            raise
        return rid

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    # -- driving --------------------------------------------------------------------------------
    def stream(self) -> Iterator[FrameChunk]:
        """Step the engine until no request is left, yielding chunks as they fill."""
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                yield from self._chunks(out)

    def generate(
        self, prompts: Sequence[Any], params: TTSParams | Sequence[TTSParams], use_tqdm: bool = True
    ) -> list[TTSOutput]:
        """Run ``prompts`` (each ``[N, channels]`` rows) to their end; outputs in input order.
        It drives the engine itself: chunks of requests added by other callers are dropped."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} given for {len(prompts)} prompts")
        ids = [self.add_request(rows, p) for rows, p in zip(prompts, plist, strict=True)]
        wanted = set(ids)
        rows: dict[str, list[np.ndarray]] = {i: [] for i in ids}
        done: dict[str, FrameChunk] = {}
        cached: dict[str, int] = {}
        total = sum(p.max_frames for p in plist)
        with tqdm(total=total, desc="frames", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while wanted - set(done):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine ran dry before every request finished")
                for out in self.engine.step():
                    if out.request_id in wanted:
                        cached[out.request_id] = out.num_cached_tokens
                    for chunk in self._chunks(out):
                        if chunk.request_id in wanted:
                            rows[chunk.request_id].append(chunk.rows)
                            bar.update(len(chunk.rows))
                            if chunk.final:
                                done[chunk.request_id] = chunk
        return [
            TTSOutput(i, np.concatenate(rows[i]), done[i].finish_reason, cached[i]) for i in ids
        ]

    def _chunks(self, out: RequestOutput) -> Iterator[FrameChunk]:
        st = self._streams.get(out.request_id)
        if st is None:
            return
        sample = out.outputs[0]
        new = sample.rows or []
        if out.finished and new and new[-1][0] == self.end_id:
            new = new[:-1]  # the end frame: not audio
        st.pending.extend(new)
        p = st.params
        while True:
            size = p.initial_chunk_frames if st.chunks == 0 else p.chunk_frames
            if len(st.pending) < size or (out.finished and len(st.pending) == size):
                break  # not full yet, or the last chunk (which carries ``final``)
            yield self._chunk(out.request_id, st, size, final=False, reason=None)
        if out.finished:
            del self._streams[out.request_id]
            yield self._chunk(out.request_id, st, len(st.pending), True, sample.finish_reason)

    def _chunk(self, rid: str, st: _Stream, n: int, final: bool, reason: str | None) -> FrameChunk:
        rows = np.asarray(st.pending[:n], dtype=np.int64).reshape(n, self.channels)
        del st.pending[:n]
        st.chunks += 1
        audio = None
        if self.codec is not None:
            codes = rows[:, 1:]
            empty = np.zeros((0, codes.shape[1]), dtype=np.int64)
            context = st.context if st.context is not None else empty
            audio = np.asarray(self.codec.decode(codes, context), dtype=np.float32)
            k = self.codec.context_frames
            st.context = np.concatenate([context, codes])[-k:] if k else empty
        return FrameChunk(rid, rows, final, reason, audio)

    # -- lifecycle ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return self.llm.stats()

    def summary(self) -> str:
        return self.llm.summary()

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> TTSEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_rows(rows: Any) -> Any:
    """A numpy array, a tensor or nested lists -> an int64 tensor (checked by the engine)."""
    if isinstance(rows, np.ndarray):
        if not np.issubdtype(rows.dtype, np.integer):
            raise ValueError(f"prompt rows: dtype {rows.dtype}; expected integers")
        return torch.from_numpy(rows.astype(np.int64, copy=False))
    return rows
