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
from collections.abc import Callable
from types import TracebackType
from typing import Any

from hyloop.framework.outputs import RequestOutput
from hyloop.framework.sampling_params import SamplingParams
from hyloop.recipes.job_output import InOrder, JobOutput

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


class RecordWriter(InOrder):
    """Writes each line's record in input order (``InOrder``) to ``out`` (a ``JobOutput``;
    with no path, the texts to stdout); errors also go to stderr. Leaving with rows missing is
    an error unless ``partial`` (a drained job: they run on resume)."""

    def __init__(self, out: JobOutput, lines: list[Line], start: int = 0) -> None:
        super().__init__(out, start)
        self.lines, self.to_file = lines, out.path is not None
        self.failed = self.prompt_tokens = self.cached_tokens = 0
        self.partial = False

    def line(self, i: int, result: dict[str, Any]) -> str:
        rec = dict(self.lines[i].row or {})
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
            if not self.to_file:
                prompt = next(rec[f] for f in PROMPT_FIELDS if f in rec)
                text = rec["text"] if rec["text"] is not None else rec["token_ids"]
                print(f"\n>>> {prompt}\n{text}")
        return json.dumps(rec) + "\n"  # ASCII: whatever a row held, the line encodes

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.out.close()
        if kind is None and not self.partial and self.written != len(self.lines):
            raise RuntimeError(f"{len(self.lines) - self.written} rows got no result")


def same_record(lines: list[Line]) -> Callable[[int, dict[str, Any]], bool]:
    """Whether output record ``k`` was written for input line ``k`` (it holds the row's own
    fields as given; a line that was no JSON object gets a record of ``error`` alone)."""

    def same(k: int, record: dict[str, Any]) -> bool:
        row = lines[k].row
        if row is None:
            return set(record) == {"error"}
        return all(_canon(record.get(key)) == _canon(v) for key, v in row.items())

    return same


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
