"""The TTS front end: text or rows in, a stream of frame chunks (and audio) out per request.

``TTSEngine`` assembles a frame model (``model_type: moss_tts_local``) from a config like ``LLM``
does and drives the same engine. A request is prompt rows ``[N, channels]`` (text id + codes),
or text with an optional voice reference that ``hyloop.tts.prompts`` turns into rows in the
checkpoint's request format. A request's first chunk holds ``initial_chunk_frames`` frames,
later ones ``chunk_frames``, its last one the rest (maybe none) with ``final=True``, the finish
reason and the request's ``TTSMetrics``. The end frame that stops a request is not part of its
rows. With a ``codec``, each chunk carries the float32 PCM of its frames and its sample rate.
Three ways to drive it:

* ``stream(request_id)``: that request's chunks, ``for`` or ``async for``. The first call starts
  one loop thread that steps the engine for every live request; a codec runs on a thread of its
  own (``CodecStage``), so the loop never waits on audio or on a consumer.
* ``stream()``: every request's chunks on the caller's thread (scripts; codec inline).
* ``generate(prompts, params)``: to the end, outputs in input order.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from hyloop.api.llm import LLM
from hyloop.framework.config import EngineConfig
from hyloop.framework.outputs import RequestOutput
from hyloop.tts.chunker import (
    RequestState,
    TTSOutput,
    as_rows,
    chunk_output,
    decode_inline,
    join_chunks,
)
from hyloop.tts.codec import Codec, CodecStage
from hyloop.tts.frame_step import FrameStep
from hyloop.tts.metrics import FrameChunk, RequestTimer
from hyloop.tts.params import TTSParams
from hyloop.tts.prompts import PromptBuilder, TTSPrompt
from hyloop.tts.streams import RequestStream

MOSS_FRAME_RATE = 12.5  # frames per second of MOSS-Audio-Tokenizer-v2


class TTSEngine:
    """``TTSEngine(model, config=None, overrides=(), codec=None)``: a context manager over one
    engine. ``frame_rate`` (frames per second of audio) defaults to the codec's, else 12.5."""

    def __init__(
        self,
        model: str | Path,
        config: str | Path | list[str | Path] | EngineConfig | None = None,
        overrides: Sequence[str] = (),
        codec: Codec | None = None,
        frame_rate: float | None = None,
    ) -> None:
        self.llm = LLM(model=model, config=config, overrides=list(overrides))
        self.engine = self.llm.engine
        if not isinstance(self.engine.kind, FrameStep):
            self.llm.close()
            raise ValueError(f"model {model}: not a frame (TTS) model; use hyloop.LLM for it")
        self.channels = self.engine.derived.row_channels
        self.end_id = self.engine.derived.end_id
        self.codec = codec
        if frame_rate is None:
            frame_rate = codec.sample_rate / codec.samples_per_frame if codec else MOSS_FRAME_RATE
        self.frame_rate = float(frame_rate)
        self._requests: dict[str, RequestState] = {}
        self._outlets: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stage: CodecStage | None = None
        self._closing = False
        self._driving = False  # stream() / generate() step the engine on a caller's thread
        self._failure: str | None = None
        self._builder: PromptBuilder | None = None

    def set_codec(self, codec: Codec | None) -> None:
        """Swap the codec (None: frames only) while no request is live."""
        with self._lock:
            if self._requests:
                raise RuntimeError(f"set_codec: {len(self._requests)} request(s) still live")
            old, self._stage = self._stage, None
            self.codec = codec
            if codec is not None:
                self.frame_rate = codec.sample_rate / codec.samples_per_frame
                if self._thread is not None:
                    self._stage = CodecStage(codec, self._deliver_audio)
        if old is not None:
            old.close()

    # -- requests -------------------------------------------------------------------------------
    def prompt_rows(self, text: str, voice: Any = None, **fields: Any) -> np.ndarray:
        """The prompt rows of ``text`` spoken in ``voice`` (``TTSPrompt``'s fields)."""
        if self._builder is None:
            self._builder = PromptBuilder(self.engine.tokenizer, self.engine.model.config)
        return self._builder.build(TTSPrompt.from_fields(dict(fields, text=text, voice=voice)))

    def add_request(
        self,
        rows: Any = None,
        params: TTSParams | None = None,
        request_id: str | None = None,
        *,
        text: str | None = None,
        voice: Any = None,
        **fields: Any,
    ) -> str:
        """Queue a request (any thread): prompt ``rows`` ``[N, channels]``, or ``text`` with an
        optional ``voice`` (a reference's codes ``[n, n_vq]``) and ``TTSPrompt`` fields."""
        if params is None:
            raise ValueError("params: missing; pass TTSParams(max_frames=...)")
        if not isinstance(params, TTSParams):
            raise ValueError(f"params: got {type(params).__name__}; expected TTSParams")
        params.validate()
        if (rows is None) == (text is None):
            raise ValueError("give exactly one of prompt rows or text=")
        if rows is None:
            rows = self.prompt_rows(str(text) if text is not None else "", voice, **fields)
        elif voice is not None or fields:
            raise ValueError("voice= and prompt fields go with text=, not with prompt rows")
        rid = request_id if request_id is not None else f"tts-{next(self._ids)}"
        with self._lock:
            if self._failure is not None:
                raise RuntimeError(f"the TTS engine loop stopped: {self._failure}")
            if rid in self._requests or rid in self._outlets:
                raise ValueError(f"request {rid!r}: id already in use")
            self._requests[rid] = RequestState(params, RequestTimer(self.frame_rate))
            self._outlets[rid] = RequestStream(rid, self.abort, self._outlet_done)
        try:
            self.engine.add_request(rid, as_rows(rows), params.sampling())
        except Exception:
            with self._lock:
                self._requests.pop(rid, None)
                self._outlets.pop(rid, None)
            raise
        with self._wake:
            self._wake.notify_all()
        return rid

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def _outlet_done(self, request_id: str) -> None:
        with self._lock:
            self._outlets.pop(request_id, None)

    # -- per-request streams (one loop thread) --------------------------------------------------
    def stream(self, request_id: str | None = None) -> Any:
        """``stream(request_id)``: that request's ``RequestStream`` (``for`` / ``async for``),
        fed by the engine loop thread (started here if it is not running). ``stream()``: every
        request's chunks, stepping the engine on the caller's thread."""
        if request_id is None:
            return self._drive()
        with self._lock:
            outlet = self._outlets.get(request_id)
            if outlet is None:
                raise ValueError(f"request {request_id!r}: unknown, or its stream was consumed")
            if self._driving:
                raise RuntimeError(f"stream({request_id!r}): stream() drives the engine now")
            if self._thread is None:
                if self._closing:
                    raise RuntimeError("TTSEngine: closed")
                if self.codec is not None:
                    self._stage = CodecStage(self.codec, self._deliver_audio)
                self._thread = threading.Thread(target=self._loop, name="hyloop-tts", daemon=True)
                self._thread.start()
        return outlet

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closing and not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                if self._closing:
                    return
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - not one request's: every stream ends
                self._fail_all(f"{type(e).__name__}: {e}")
                return
            for out in outs:
                for chunk in self._chunks(out):
                    self._route(chunk)

    def _route(self, chunk: FrameChunk) -> None:
        if self._stage is not None:
            self._stage.submit(chunk.request_id, chunk, chunk.rows[:, 1:], chunk.final)
        else:
            self._deliver(chunk)

    def _deliver_audio(
        self, rid: str, chunk: FrameChunk, audio: np.ndarray | None, error: str | None
    ) -> None:
        chunk.audio, chunk.sample_rate = audio, self.codec.sample_rate if self.codec else None
        if error is not None and chunk.error is None:
            chunk.error = error
        self._deliver(chunk)

    def _deliver(self, chunk: FrameChunk, feed: bool = True) -> None:
        """Time ``chunk`` and (``feed``) put it in its request's stream."""
        with self._lock:
            outlet = self._outlets.get(chunk.request_id)
            req = self._requests.get(chunk.request_id)
            if chunk.final:
                self._requests.pop(chunk.request_id, None)
        if req is not None:
            req.timer.delivered(len(chunk.rows), chunk.final)
            if chunk.final:
                chunk.metrics = req.timer.metrics(outlet.max_buffered if outlet else 0)
        if outlet is not None and feed:
            outlet.put(chunk)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            self._failure = message
            live = list(self._requests)
        for rid in live:
            empty = np.zeros((0, self.channels), dtype=np.int64)
            self._deliver(FrameChunk(rid, empty, True, "error", error=message))

    # -- driving on the caller's thread ---------------------------------------------------------
    def _drive(self) -> Iterator[FrameChunk]:
        with self._lock:
            if self._thread is not None or self._driving:
                raise RuntimeError("stream(): the engine is driven already; use stream(request_id)")
            self._driving = True
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    for chunk in self._chunks(out):
                        req = self._requests.get(chunk.request_id)
                        if self.codec is not None and req is not None:
                            decode_inline(self.codec, req, chunk)
                        self._deliver(chunk, feed=False)
                        if chunk.final:  # its chunks went to this caller, not to a stream
                            with self._lock:
                                self._outlets.pop(chunk.request_id, None)
                        yield chunk
        finally:
            with self._lock:
                self._driving = False

    def generate(
        self, prompts: Sequence[Any], params: TTSParams | Sequence[TTSParams], use_tqdm: bool = True
    ) -> list[TTSOutput]:
        """Run ``prompts`` (rows ``[N, channels]``, or ``TTSPrompt``\\ s) to their end; outputs in
        input order (``generate_iter`` hands each over as soon as the ones before it are)."""
        return [out for _, out in self.generate_iter(prompts, params, use_tqdm)]

    def generate_iter(
        self, prompts: Sequence[Any], params: TTSParams | Sequence[TTSParams], use_tqdm: bool = True
    ) -> Iterator[tuple[int, TTSOutput]]:
        """``(index, output)`` in input order, each as soon as it and those before it are done.
        Without the loop thread it steps the engine itself (chunks of requests added by other
        callers are then dropped); with it, it reads each request's stream."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} given for {len(prompts)} prompts")
        ids = [self._add_prompt(prompt, p) for prompt, p in zip(prompts, plist, strict=True)]
        chunks: dict[str, list[FrameChunk]] = {i: [] for i in ids}
        total = sum(p.max_frames for p in plist)
        with tqdm(total=total, desc="frames", disable=not use_tqdm, dynamic_ncols=True) as bar:
            if self._thread is not None:
                for k, rid in enumerate(ids):
                    for chunk in self.stream(rid):
                        chunks[rid].append(chunk)
                        bar.update(len(chunk.rows))
                    yield k, join_chunks(rid, chunks[rid], self.codec)
                return
            done, k = set(), 0
            for chunk in self._drive():
                if chunk.request_id in chunks:
                    chunks[chunk.request_id].append(chunk)
                    bar.update(len(chunk.rows))
                    done |= {chunk.request_id} if chunk.final else set()
                    while k < len(ids) and ids[k] in done:
                        yield k, join_chunks(ids[k], chunks[ids[k]], self.codec)
                        k += 1
            for rest in range(k, len(ids)):  # the engine ran dry: ``_output`` says which
                yield rest, join_chunks(ids[rest], chunks[ids[rest]], self.codec)

    def _add_prompt(self, prompt: Any, params: TTSParams) -> str:
        if isinstance(prompt, TTSPrompt):
            fields = {k: getattr(prompt, k) for k in prompt.__dataclass_fields__}
            return self.add_request(None, params, **fields)
        return self.add_request(prompt, params)

    def _chunks(self, out: RequestOutput) -> Iterator[FrameChunk]:
        req = self._requests.get(out.request_id)
        return iter(()) if req is None else chunk_output(req, out, self.channels, self.end_id)

    # -- lifecycle ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        stats = self.llm.stats()
        if self._stage is not None:
            stats["codec_decode_s"] = self._stage.decode_s
        return stats

    def summary(self) -> str:
        return self.llm.summary()

    def close(self) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self._stage is not None:
            self._stage.close()
        with self._lock:
            live = [rid for rid in self._requests if rid in self._outlets]
        for rid in live:  # nobody will step them any more
            empty = np.zeros((0, self.channels), dtype=np.int64)
            self._deliver(FrameChunk(rid, empty, True, "abort", error="the TTS engine closed"))
        self.llm.close()

    def __enter__(self) -> TTSEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
