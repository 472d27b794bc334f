"""``hyloop tts``: TTS requests in (JSONL), frames (``.npy``) and audio (``.wav``) out.

Each input line is one request, its prompt given one of two ways:

* ``text`` (what to say), with an optional voice reference ``voice`` (its codes, a list of
  ``[n_vq]`` int lists) or ``voice_npy`` (an ``.npy`` of them, relative to the JSONL), and the
  template's fields (``instruction``, ``tokens``, ``quality``, ``sound_event``,
  ``ambient_sound``, ``language``); the checkpoint's tokenizer builds the rows;
* prompt rows inline (``rows``: a list of ``[channels]`` int lists) or as ``rows_npy``;

plus ``TTSParams`` fields (``max_frames`` required; ``seed``, ``audio_temperature``, ...). Each
output line keeps the input fields and adds ``frames`` (the ``.npy`` of the generated rows
``[n, channels]``, beside the output), ``num_frames``, ``finish_reason``, ``num_cached_rows``,
and with ``--codec`` ``audio`` (a 16-bit ``.wav``), ``sample_rate``, ``time_to_first_audio_s``
and ``rtf``; input order kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hyloop.api.engine_args import EngineArgs
from hyloop.framework.prompts import row_prompt
from hyloop.recipes.job import JobSignals, check_strings, row_key, row_seed
from hyloop.recipes.job_output import JobOutput, fingerprint
from hyloop.recipes.offline import check_model, read_rows
from hyloop.recipes.records import Line, same_record
from hyloop.recipes.tts_records import FrameWriter
from hyloop.tts import ToneCodec, TTSEngine, TTSParams, TTSPrompt
from hyloop.tts.codec import Codec

ROW_FIELDS = ("rows", "rows_npy")
VOICE_FIELDS = ("voice", "voice_npy")
PROMPT_FIELDS = tuple(f.name for f in dataclasses.fields(TTSPrompt) if f.name != "voice")


def _ints(value: Any, where: str, what: str) -> np.ndarray:
    try:
        return np.asarray(value, dtype=np.int64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {what}: expected a list of int rows ({e})") from None


def _npy(base: Path, name: Any, where: str, what: str) -> np.ndarray:
    path = base / str(name)
    if not path.is_file():
        raise ValueError(f"{where}: {what}: no file {path}")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{where}: {what}: {path} is not an .npy array ({e})") from None


def _prompt(row: dict[str, Any], base: Path, where: str) -> tuple[Any, dict[str, Any]]:
    """(rows or a ``TTSPrompt``, the remaining fields: ``TTSParams``')."""
    rows_given = [f for f in ROW_FIELDS if f in row]
    if ("text" in row) == bool(rows_given) or len(rows_given) > 1:
        raise ValueError(f"{where}: give exactly one of `text`, `rows` or `rows_npy`")
    rest = {k: v for k, v in row.items() if k not in (*ROW_FIELDS, *VOICE_FIELDS, "id")}
    if rows_given:
        if any(f in row for f in VOICE_FIELDS):
            raise ValueError(f"{where}: `voice` goes with `text`, not with prompt rows")
        if "rows" in row:
            return _ints(row["rows"], where, "rows"), rest
        return _npy(base, row["rows_npy"], where, "rows_npy"), rest
    voices = [f for f in VOICE_FIELDS if f in row]
    if len(voices) > 1:
        raise ValueError(f"{where}: give at most one of `voice` or `voice_npy`")
    voice = None
    if voices == ["voice"]:
        voice = _ints(row["voice"], where, "voice")
    elif voices:
        voice = _npy(base, row["voice_npy"], where, "voice_npy")
    fields = {k: rest.pop(k) for k in PROMPT_FIELDS if k in rest}
    return TTSPrompt.from_fields(dict(fields, voice=voice), where), rest


@dataclass
class Entry:
    """A non-blank input line: its record line and, when it can run, its prompt and params."""

    line: Line
    prompt: Any = None
    params: TTSParams | None = None


def load_requests(path: str) -> tuple[bytes, list[Entry]]:
    """Every non-blank line, checked without the model; a bad one carries its error
    (``<input>:<line>: <field>: <reason>``) and the others still run."""
    base = Path(path).parent
    ready: dict[str, tuple[Any, TTSParams]] = {}

    def check(where: str, row: Any) -> None:
        try:
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            check_strings(where, row)
            prompt, fields = _prompt(row, base, where)
            ready[where] = (prompt, TTSParams.from_dict(fields, where))
        except ValueError as e:
            raise ValueError(_field_error(where, str(e))) from None

    data, lines = read_rows(path, check)
    return data, [Entry(n, *ready.get(f"{path}:{n.number}", (None, None))) for n in lines]


def _field_error(where: str, message: str) -> str:
    """``where.field: reason`` (the params' own naming) as ``where: field: reason``."""
    message = re.sub(r"^request '[^']*': ", "", message)
    if message.startswith(f"{where}."):
        return f"{where}: {message[len(where) + 1 :]}"
    return message if message.startswith(where) else f"{where}: {message}"


def load_codec(spec: str | None) -> Codec | None:
    """``tone`` (``ToneCodec``, 48 kHz) or ``package.module:factory`` (called with no
    arguments)."""
    if not spec:
        return None
    if spec == "tone":
        return ToneCodec()
    module, sep, attr = spec.partition(":")
    if not sep:
        raise ValueError(f"--codec {spec!r}: expected 'tone' or module:factory")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--codec {spec!r}: {e}") from None
    return factory()


def run_tts(args: argparse.Namespace) -> int:
    """0 when every line ran, 1 when some failed (each with its record's ``error``, on stderr
    too), 130 / 143 after a signal (``--resume`` finishes it); 2 for a command-line error."""
    if not args.model:
        raise ValueError("--model: a TTS checkpoint directory is required")
    if not args.input or not args.output:
        raise ValueError("--input and --output are required (JSONL in, JSONL out)")
    data, entries = load_requests(args.input)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)  # the frames' folder too
    check_model(args.model)
    codec = load_codec(getattr(args, "codec", None))
    config = EngineArgs(model=args.model, config=args.config or None, overrides=args.overrides)
    cfg = config.create_engine_config()
    lines = [e.line for e in entries]
    out = JobOutput(args.output)
    done = out.check(args.input, getattr(args, "resume", False), len(lines), same_record(lines))
    job = fingerprint(data, {"tts": cfg.model_dump(), "codec": getattr(args, "codec", None)})
    out_path = Path(args.output)
    with JobSignals() as signals, TTSEngine(args.model, config=cfg, codec=codec) as tts:
        for n, e in enumerate(entries):
            if n >= done and e.line.error is None and e.params is not None:
                _check_entry(tts, e, args.input, cfg.seed)
        out.open(job)
        signals.start(tts.llm.drain)
        writer = FrameWriter(out, out_path, lines, done)
        for n, e in enumerate(entries):
            if n >= done and e.line.error is not None:
                writer.put(n, None, e.line.error)
        todo = [n for n, e in enumerate(entries) if n >= done and e.line.error is None]
        step = max(1, cfg.scheduler.max_running_requests)  # one batch runs at a time
        for k in range(0, len(todo), step):
            if tts.llm.draining:
                break
            batch = todo[k : k + step]
            prompts = [entries[n].prompt for n in batch]
            params = [p for n in batch if (p := entries[n].params) is not None]
            # Each line's record as soon as it and the lines before it are done.
            for i, res in tts.generate_iter(prompts, params, use_tqdm=not args.no_progress):
                writer.put(batch[i], res, None)
        out.close()
        if not args.no_progress and signals.signum is None:
            print(tts.summary(), file=sys.stderr)
    if signals.exit_code is not None:
        return signals.report("tts", writer.written, len(lines), args.output, "lines")
    return 1 if writer.failed else 0


def _check_entry(tts: TTSEngine, e: Entry, path: str, seed: int) -> None:
    """The line's prompt rows, checked against the model (a bad voice code, an id outside a
    channel's vocabulary) into ``e.prompt``; a failure becomes the line's error."""
    where = f"{path}:{e.line.number}"
    assert e.params is not None and e.line.row is not None
    field = next((f for f in (*ROW_FIELDS, *VOICE_FIELDS) if f in e.line.row), "text")
    try:
        if isinstance(e.prompt, TTSPrompt):
            fields = {k: getattr(e.prompt, k) for k in PROMPT_FIELDS}
            e.prompt = tts.prompt_rows(**fields, voice=e.prompt.voice)
        d = tts.engine.derived
        sampling = e.params.sampling()
        row_prompt(where, e.prompt, sampling, list(d.channel_vocab_sizes), d.max_context, d.end_id)
    except ValueError as err:
        message = re.sub(r"^request '[^']*': ", "", str(err))
        named = message.startswith((f"{field}:", f"{field} "))  # voice_rows names its field
        e.line.error = f"{where}: {message}" if named else f"{where}: {field}: {message}"
        return
    if e.params.seed is None:  # the line's own seed: the same however the lines are batched
        key = row_key(e.line.row, e.line.number)
        e.params = dataclasses.replace(e.params, seed=row_seed(seed, key))
