"""The records ``hyloop generate`` writes, one per non-blank input line, in input order.

A record holds the row's input fields, plus

- when the row ran: ``text`` (None when the model has no tokenizer or the row sets
  ``detokenize: false``), ``token_ids``, ``finish_reason`` (``stop`` | ``length``),
  ``stop_reason`` (the stop token id that ended it, else None), ``num_prompt_tokens`` and
  ``num_cached_tokens``; and for a row with ``logprobs: k``, ``cumulative_logprob`` and
  ``logprobs`` (in place of k): one list per generated token of
  ``{"token_id", "logprob", "rank", "decoded_token"}`` objects, the sampled token first, then
  the top-k by rank (the sampled token is listed once, so a position holds k or k + 1 entries);
- when it failed: only ``error``, a message naming ``file:line`` and the field (a line that is
  not a JSON object keeps no input fields).

The local and the Ray path build records from the same result fields (``result_fields``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from types import TracebackType
from typing import Any

from hyloop.framework.outputs import RequestOutput
from hyloop.framework.sampling_params import SamplingParams

PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")  # a row gives exactly one
RECORD_FIELDS = (  # what every record of a row that ran adds
    "text",
    "token_ids",
    "finish_reason",
    "stop_reason",
    "num_prompt_tokens",
    "num_cached_tokens",
)


@dataclasses.dataclass
class Line:
    """A non-blank input line: its number, its row (None: not a JSON object) and why it fails."""

    number: int
    row: dict[str, Any] | None
    error: str | None = None


def logprobs_json(out: RequestOutput) -> list[list[dict[str, Any]]] | None:
    """The requested logprobs as JSON: per generated token, the sampled token then the top-k."""
    sample = out.outputs[0]
    if sample.logprobs is None:
        return None
    positions = []
    for tok, entry in zip(sample.token_ids, sample.logprobs, strict=False):
        order = [tok, *(t for t in sorted(entry, key=lambda t: entry[t].rank or 0) if t != tok)]
        positions.append([{"token_id": t, **dataclasses.asdict(entry[t])} for t in order])
    return positions


def result_fields(out: RequestOutput, params: SamplingParams, has_text: bool) -> dict[str, Any]:
    """What a finished request adds to its row (``error`` None, unless it failed in the
    engine: ``framework.faults``); see the module docstring."""
    if out.error is not None:
        return failed_fields(out.error)
    sample = out.outputs[0]
    return {
        "text": sample.text if has_text and params.detokenize else None,
        "token_ids": list(sample.token_ids),
        "finish_reason": sample.finish_reason,
        "stop_reason": sample.stop_reason,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "cumulative_logprob": sample.cumulative_logprob,
        "logprobs": logprobs_json(out),
        "error": None,
    }


def failed_fields(error: str) -> dict[str, Any]:
    """``result_fields`` of a row that could not run."""
    return {
        **dict.fromkeys(("text", "stop_reason", "cumulative_logprob", "logprobs")),
        "token_ids": [],
        "finish_reason": "error",
        "num_prompt_tokens": 0,
        "num_cached_tokens": 0,
        "error": error,
    }


class RecordWriter:
    """Writes each line's record in input order as results come in, in any order: to
    ``output`` (JSONL) or, with none, the texts to stdout; errors also go to stderr."""

    def __init__(self, output: str | None, lines: list[Line]) -> None:
        self.lines = lines
        self.fh = open(output, "w") if output else None  # noqa: SIM115
        self.pending: dict[int, dict[str, Any]] = {}
        self.written = self.failed = self.prompt_tokens = self.cached_tokens = 0

    def put(self, i: int, result: dict[str, Any]) -> None:
        self.pending[i] = result
        while self.written in self.pending:
            self._write(self.lines[self.written], self.pending.pop(self.written))
            self.written += 1

    def _write(self, line: Line, result: dict[str, Any]) -> None:
        rec = dict(line.row or {})
        if result["error"] is not None:
            self.failed += 1
            rec = {**rec, "error": result["error"]}
            print(f"hyloop: error: {result['error']}", file=sys.stderr)
        else:
            rec.update({k: result[k] for k in RECORD_FIELDS})
            if result["logprobs"] is not None:  # only rows that asked for them
                rec.update({k: result[k] for k in ("cumulative_logprob", "logprobs")})
            self.prompt_tokens += result["num_prompt_tokens"]
            self.cached_tokens += result["num_cached_tokens"]
            if self.fh is None:
                prompt = next(rec[f] for f in PROMPT_FIELDS if f in rec)
                text = rec["text"] if rec["text"] is not None else rec["token_ids"]
                print(f"\n>>> {prompt}\n{text}")
        if self.fh is not None:
            self.fh.write(json.dumps(rec) + "\n")

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.fh is not None:
            self.fh.close()
        if kind is None and self.written != len(self.lines):
            raise RuntimeError(f"{len(self.lines) - self.written} rows got no result")
