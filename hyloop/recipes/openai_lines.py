"""The output lines of ``hyloop run-batch``: a finished request's ChatCompletion or Completion
body as vLLM's server returns it, or the error line of a row that got none."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from hyloop.framework.outputs import CompletionOutput, Logprob, RequestOutput
from hyloop.recipes.openai_batch import CHAT, BatchRow, RowError


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
