"""``hyloop run-batch``: vLLM's ``run-batch``, an OpenAI Batch file in and its output file out.

Every input line is checked before the model loads (``openai_batch``; a file with no valid line
never loads it); a bad line gets its own error line and the others still run. Output lines, the
``/v1/chat/completions`` or ``/v1/completions`` response bodies vLLM writes, keep the input's
order and are written as requests finish, each once the lines before it are out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import sys
import time
import uuid
from collections.abc import Iterator
from typing import IO, Any

from tqdm.auto import tqdm

from hyloop.framework.chat import render_chat
from hyloop.framework.engine_args import EngineArgs
from hyloop.framework.llm import LLM
from hyloop.framework.outputs import CompletionOutput, Logprob, RequestOutput
from hyloop.framework.prompts import TokensPrompt
from hyloop.framework.sampling_params import RequestOutputKind, SamplingParams
from hyloop.recipes.offline import default_checkpoint
from hyloop.recipes.openai_batch import (
    CHAT,
    BatchRow,
    RowError,
    parse_rows,
)

log = logging.getLogger(__name__)


class OrderedWriter:
    """Writes output line ``i`` once lines ``0..i-1`` are written: results come in any order,
    the file keeps the input's and is flushed as it grows."""

    def __init__(self, fh: IO[str], bar: Any) -> None:
        self.fh, self.bar = fh, bar
        self.next = 0
        self.waiting: dict[int, dict[str, Any]] = {}
        self.errors = 0

    def put(self, index: int, record: dict[str, Any]) -> None:
        self.waiting[index] = record
        self.errors += record["error"] is not None
        self.bar.update(1)
        if self.next not in self.waiting:
            return
        while self.next in self.waiting:
            self.fh.write(json_line(self.waiting.pop(self.next)))
            self.next += 1
        self.fh.flush()


def json_line(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n"


def read_lines(path: str) -> list[str]:
    """The input file's lines (``-``: stdin); a missing file raises FileNotFoundError."""
    if path == "-":
        return sys.stdin.read().splitlines()
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"--input-file {path}: no such file") from None


@contextlib.contextmanager
def open_output(path: str) -> Iterator[IO[str]]:
    """The output file (``-``: stdout), opened before the model loads so a bad path fails
    first."""
    if path == "-":
        yield sys.stdout
        return
    with open(path, "w", encoding="utf-8") as fh:
        yield fh


def run_batch(args: argparse.Namespace) -> int:
    """The CLI entry: read and check the file, then (if any line is valid) load and run."""
    name = args.served_model_name
    rows = parse_rows(read_lines(args.input_file), name or None)
    model = args.model or str(default_checkpoint())
    served = name or model
    valid = [i for i, r in enumerate(rows) if r.error is None]
    if not name:
        others = sorted({m for i in valid if (m := rows[i].body.get("model")) not in (None, model)})
        if others:
            log.warning(
                "body.model %s differs from the served model %r; running them on it (give "
                "--served-model-name to refuse other names)",
                ", ".join(map(repr, others)),
                served,
            )
    summary = None
    with open_output(args.output_file) as fh:
        bar = tqdm(total=len(rows), desc="run-batch", disable=args.no_progress, dynamic_ncols=True)
        writer = OrderedWriter(fh, bar)
        try:
            if not valid:
                write_errors(rows, writer)
            else:
                args.model = model
                with LLM.from_engine_args(EngineArgs.from_cli_args(args)) as llm:
                    write_errors(rows, writer)  # once the model loaded: no partial output
                    run_rows(llm, rows, valid, writer, served)
                    summary = llm.summary()
        finally:
            bar.close()
    if summary is not None:
        print("\n" + summary, file=sys.stderr)
    where = "stdout" if args.output_file == "-" else args.output_file
    print(f"run-batch: {len(rows)} lines to {where}, {writer.errors} errors", file=sys.stderr)
    return 0


def write_errors(rows: list[BatchRow], writer: OrderedWriter) -> None:
    for i, row in enumerate(rows):
        if row.error is not None:
            writer.put(i, error_line(row, row.error))


def run_rows(
    llm: LLM, rows: list[BatchRow], valid: list[int], writer: OrderedWriter, served: str
) -> None:
    """Queue each valid row (one the model refuses, a context too long or an unknown token
    id, gets its error line and the rest still run), then step the engine until all finish."""
    engine = llm.engine
    defaults = llm.get_default_sampling_params()
    # vLLM's server rule: a chat without max tokens may fill the context (or the checkpoint's
    # max_new_tokens); a completion takes the request default.
    chat_max = defaults.max_tokens if "max_tokens" in engine.derived.sampling_defaults else None
    live: dict[str, int] = {}
    try:
        for i in valid:
            row = rows[i]
            try:
                prompt = row_prompt(row, llm.tokenizer)
                params = row_params(row, defaults, chat_max)
                engine.add_request(row.request_id, prompt, params)
            except Exception as e:  # one row's failure is its own error line
                if not isinstance(e, ValueError):
                    log.exception("%s: could not add the request", row.where)
                writer.put(i, error_line(row, _row_error(row, e)))
                continue
            live[row.request_id] = i
        while live and engine.has_unfinished_requests():
            for out in engine.step():
                i = live.pop(out.request_id, None) if out.finished else None
                if i is not None and out.error is not None:  # it failed in the engine
                    msg = f"{rows[i].where}: {out.error}"
                    writer.put(i, error_line(rows[i], RowError(msg, 500, "internal_error")))
                elif i is not None:
                    writer.put(i, success_line(rows[i], out, served))
    finally:
        if live:
            engine.abort_request(list(live))
    for rid, i in live.items():  # the engine ran dry without finishing them: never expected
        msg = f"{rows[i].where}: request {rid} ended without an output"
        writer.put(i, error_line(rows[i], RowError(msg, status=500, code="internal_error")))


def row_prompt(row: BatchRow, tokenizer: Any) -> str | list[int] | dict[str, Any]:
    """A completion's prompt, or a chat rendered with the checkpoint's chat template; a prompt
    dict with the row's ``cache_salt`` when it has one."""
    if row.url != CHAT:
        assert row.prompt is not None
        prompt: str | list[int] | TokensPrompt = row.prompt
    else:
        where = f"{row.where}: body"
        prompt = render_chat(where, row.body["messages"], tokenizer, **row.chat_kwargs)
    if row.cache_salt is None:
        return prompt
    if isinstance(prompt, dict):
        return {**prompt, "cache_salt": row.cache_salt}
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {key: prompt, "cache_salt": row.cache_salt}


def row_params(row: BatchRow, defaults: SamplingParams, chat_max: int | None) -> SamplingParams:
    """The request defaults with the body's fields over them; final output only."""
    fields = dict(row.sampling)
    if row.url == CHAT and "max_tokens" not in fields:
        fields["max_tokens"] = chat_max
    params = dataclasses.replace(defaults, **fields, output_kind=RequestOutputKind.FINAL_ONLY)
    params.validate(f"{row.where}: body")
    return params


def _row_error(row: BatchRow, error: Exception) -> RowError:
    """The error as the row's error line states it, its line number in front."""
    err = RowError.of(error)
    if str(err).startswith(row.where):
        return err
    message = str(err).removeprefix(f"request {row.request_id!r}: ")  # the engine's naming
    params = f"request {row.request_id!r} sampling_params"  # its SamplingParams: the body's
    if message.startswith(params):
        message = "body" + message[len(params) :]
    return RowError(f"{row.where}: {message}", err.status, err.code)


# -- output lines ---------------------------------------------------------------------------
def error_line(row: BatchRow, error: RowError) -> dict[str, Any]:
    """The output line of a row that got no response: no body, the error's code and message."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": row.custom_id,
        "response": {"status_code": error.status, "request_id": row.request_id, "body": None},
        "error": {"code": error.code, "message": str(error)},
    }


def success_line(row: BatchRow, out: RequestOutput, model: str) -> dict[str, Any]:
    """A finished request's output line: a ChatCompletion or Completion body as vLLM's server
    returns it (``stop_reason`` is vLLM's: the stop token id that ended it)."""
    generated = sum(len(c.token_ids) for c in out.outputs)
    usage = {
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": generated,
        "total_tokens": len(out.prompt_token_ids) + generated,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }
    k = row.sampling.get("logprobs")
    chat = row.url == CHAT
    kind, prefix = ("chat.completion", "chatcmpl") if chat else ("text_completion", "cmpl")
    choices = []
    for sample in out.outputs:  # one choice per sample (``n``)
        choice: dict[str, Any] = {"index": sample.index}
        if chat:
            choice["message"] = {"role": "assistant", "content": sample.text}
            choice["logprobs"] = _chat_logprobs(sample, k) if k is not None else None
        else:
            choice["text"] = sample.text
            choice["logprobs"] = _completion_logprobs(sample, k) if k is not None else None
        choice.update(finish_reason=sample.finish_reason, stop_reason=sample.stop_reason)
        choices.append(choice)
    body = {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": row.custom_id,
        "response": {"status_code": 200, "request_id": row.request_id, "body": body},
        "error": None,
    }


def _chat_logprobs(sample: CompletionOutput, k: int) -> dict[str, Any]:
    """Chat's shape: each generated token with its bytes and the ``k`` most likely ones."""
    content = []
    for tid, entry in zip(sample.token_ids, sample.logprobs or [], strict=False):
        top = [_chat_entry(lp) for _, lp in _ranked(entry)[:k]]
        content.append({**_chat_entry(entry[tid]), "top_logprobs": top})
    return {"content": content}


def _chat_entry(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": _finite(lp.logprob), "bytes": list(token.encode())}


def _completion_logprobs(sample: CompletionOutput, k: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, ``text_offset`` counted from the start
    of the generated text, and per token the ``k`` most likely ones plus the sampled one."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    offset = 0
    for tid, entry in zip(sample.token_ids, sample.logprobs or [], strict=False):
        chosen = entry[tid]
        token = chosen.decoded_token or ""
        tokens.append(token)
        token_logprobs.append(_finite(chosen.logprob))
        offsets.append(offset)
        offset += len(token)
        top: dict[str, float] = {}
        for _, lp in _ranked(entry)[:k]:
            top.setdefault(lp.decoded_token or "", _finite(lp.logprob))
        top.setdefault(token, _finite(chosen.logprob))  # OpenAI: the sampled one is always there
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _ranked(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """A position's entries, most likely first (the sampled token sits at its own rank)."""
    return sorted(
        entry.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob)
    )


def _finite(value: float) -> float:
    """JSON has no infinities: vLLM's floor for an impossible token."""
    return -9999.0 if math.isnan(value) else max(float(value), -9999.0)
