"""``hyloop run-batch``: vLLM's ``run-batch``, an OpenAI Batch file in and its output file out.

Every input line is checked before the model loads (``openai_batch``; a file with no valid line
never loads it); a bad line gets its own error line and the others still run. Output lines, the
``/v1/chat/completions`` or ``/v1/completions`` response bodies vLLM writes (``openai_lines``),
keep the input's order and are written as requests finish, each once the lines before it are
out. The output is a resumable job output (``job_output``; signals: ``job``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any

from tqdm.auto import tqdm

from hyloop.api.chat import render_chat
from hyloop.api.engine_args import EngineArgs
from hyloop.api.llm import LLM
from hyloop.framework.prompts import TokensPrompt
from hyloop.framework.sampling_params import RequestOutputKind, SamplingParams
from hyloop.recipes.job import JobSignals, read_input, row_seed
from hyloop.recipes.job_output import InOrder, JobOutput, fingerprint
from hyloop.recipes.offline import check_model, default_checkpoint
from hyloop.recipes.openai_batch import CHAT, BatchRow, RowError, parse_rows
from hyloop.recipes.openai_lines import error_line, success_line

__all__ = ["OrderedWriter", "error_line", "run_batch", "run_rows", "success_line"]
log = logging.getLogger(__name__)


class OrderedWriter(InOrder):
    """The output in input order (``InOrder``), counting the rows that failed; each result
    ticks ``bar``."""

    def __init__(self, fh: Any, bar: Any, start: int = 0) -> None:
        super().__init__(fh, start)
        self.bar, self.errors = bar, 0

    def put(self, index: int, record: dict[str, Any]) -> None:
        if index >= self.start:
            self.errors += record["error"] is not None
            self.bar.update(1)
        super().put(index, record)

    def line(self, i: int, result: dict[str, Any]) -> str:
        return json_line(result)


def json_line(record: dict[str, Any]) -> str:
    line = json.dumps(record, ensure_ascii=False, allow_nan=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # rows are checked for such text; never lose a line to it
        line = json.dumps(record, allow_nan=False)
    return line + "\n"


def run_batch(args: argparse.Namespace) -> int:
    """The CLI entry: read and check the file, the config, the model and the output; then (if
    any line is left to run) load the model and run. 0 once every line is written; 130 / 143
    when a signal stopped it (the lines written so far are whole: ``--resume`` finishes it)."""
    name = args.served_model_name
    data, texts = read_input(args.input_file, "--input-file")
    rows = parse_rows(texts, name or None)
    args.model = args.model or str(default_checkpoint())
    check_model(args.model)
    served = name or args.model
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config()  # a bad config fails here, before any output
    out = JobOutput(args.output_file, "--output-file")
    done = out.check(
        args.input_file,
        getattr(args, "resume", False),
        len(rows),
        lambda k, rec: rec.get("custom_id") == rows[k].custom_id,
    )
    job = fingerprint(data, {"run-batch": config.model_dump(), "served": served})
    valid = [i for i, r in enumerate(rows) if r.error is None and i >= done]
    _warn_other_models(rows, valid, name, args.model, served)
    summary = None
    bar = tqdm(total=len(rows), initial=done, desc="run-batch", disable=args.no_progress)
    writer = OrderedWriter(out, bar, start=done)
    with JobSignals() as signals:
        try:
            if not valid:
                out.open(job)
                write_errors(rows, writer)
            else:
                with LLM.from_engine_args(engine_args) as llm:
                    out.open(job)  # once the model loaded: a failed load leaves no output
                    signals.start(llm.drain)
                    write_errors(rows, writer)
                    run_rows(llm, rows, valid, writer, served, seed=config.seed)
                    summary = llm.summary()
        finally:
            out.close()
            bar.close()
    if summary is not None and signals.exit_code is None:  # a stopped job says one line
        print("\n" + summary, file=sys.stderr)
    where = "stdout" if args.output_file == "-" else args.output_file
    if signals.exit_code is not None:
        return signals.report("run-batch", writer.written, len(rows), where, "lines")
    print(f"run-batch: {len(rows)} lines to {where}, {writer.errors} errors", file=sys.stderr)
    return 0


def _warn_other_models(
    rows: list[BatchRow], valid: list[int], name: str | None, model: str, served: str
) -> None:
    if name:
        return
    others = sorted({m for i in valid if (m := rows[i].body.get("model")) not in (None, model)})
    if others:
        log.warning(
            "body.model %s differs from the served model %r; running them on it (give "
            "--served-model-name to refuse other names)",
            ", ".join(map(repr, others)),
            served,
        )


def write_errors(rows: list[BatchRow], writer: OrderedWriter) -> None:
    for i, row in enumerate(rows):
        if row.error is not None:
            writer.put(i, error_line(row, row.error))


def run_rows(
    llm: LLM,
    rows: list[BatchRow],
    valid: list[int],
    writer: OrderedWriter,
    served: str,
    seed: int = 0,
) -> None:
    """Queue each valid row (one the model refuses, a context too long or an unknown token
    id, gets its error line and the rest still run), then step the engine until all finish.
    A row without a seed gets ``row_seed(seed, custom_id)``. Once ``llm.drain()`` was called
    no row is added or admitted; what ends aborted is left unwritten, to run on resume."""
    engine = llm.engine
    defaults = llm.get_default_sampling_params()
    # vLLM's server rule: a chat without max tokens may fill the context (or the checkpoint's
    # max_new_tokens); a completion takes the request default.
    chat_max = defaults.max_tokens if "max_tokens" in engine.derived.sampling_defaults else None
    live: dict[str, int] = {}
    try:
        for i in valid:
            if llm.draining:
                break
            row = rows[i]
            try:
                prompt = row_prompt(row, llm.tokenizer)
                params = row_params(row, defaults, chat_max)
                if params.seed is None:
                    params.seed = row_seed(seed, row.custom_id or row.where)
                engine.add_request(row.request_id, prompt, params)
            except Exception as e:  # one row's failure is its own error line
                if not isinstance(e, ValueError):
                    log.exception("%s: could not add the request", row.where)
                writer.put(i, error_line(row, _row_error(row, e)))
                continue
            live[row.request_id] = i
        while live and engine.has_unfinished_requests():
            if llm.draining:
                llm.abort_unstarted()
            for out in engine.step():
                i = live.pop(out.request_id, None) if out.finished else None
                if i is None or any(c.finish_reason == "abort" for c in out.outputs):
                    continue  # drained before it ran: its line is written on resume
                if out.error is not None:  # it failed in the engine
                    msg = f"{rows[i].where}: {out.error}"
                    writer.put(i, error_line(rows[i], RowError(msg, 500, "internal_error")))
                else:
                    writer.put(i, success_line(rows[i], out, served))
    finally:
        if live:
            engine.abort_request(list(live))
    if llm.draining:
        return
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
