"""Fault containment: which errors end one request, and which stop the engine.

A request's own work runs under ``Scheduler.fail``: its admission, its part of a step's
preparation (window pages, track slot, its step-table row), and resolving its token (append,
logprobs, stop checks and stop strings, grammar, commits to the cache). An error there ends that
request alone: finish reason ``error``, the message in ``CompletionOutput.error``, its pages and
slots returned (nothing committed); the step goes on with the rest.

An error that is nobody's (``ENGINE_FAULTS``: a ``LedgerError`` or an ``AssertionError``, i.e. a
broken invariant) stops the engine: whatever was launched is abandoned, every running and queued
request ends with the error and is reported by that ``step()``, and the engine refuses new
requests from then on (``Engine.stopped``). Nothing is lost silently.

A step that fails as a whole at launch (the model or a graph raised) is abandoned and re-raised
from ``step()``, with its requests kept: the next ``step()`` runs them again
(``loops.run_blocking``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hyloop.framework.outputs import CompletionOutput, RequestOutput
from hyloop.pools import LedgerError

if TYPE_CHECKING:
    from hyloop.framework.loops import OverlapLoop, SyncLoop
    from hyloop.framework.requests import Request
    from hyloop.framework.scheduler import Scheduler

log = logging.getLogger(__name__)

ENGINE_FAULTS: tuple[type[BaseException], ...] = (LedgerError, AssertionError)


def is_engine_fault(error: BaseException) -> bool:
    """Whether ``error`` is a broken invariant (stops the engine), not one request's."""
    return isinstance(error, ENGINE_FAULTS)


def describe(error: BaseException) -> str:
    """The message a failed request's output carries."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def bare_output(req: Request) -> RequestOutput:
    """A failed request's last output, built without detokenizing (what failed may be its
    text): its token ids, finish reason ``error`` and the message."""
    sample = CompletionOutput(0, "", list(req.output_ids), None, None, "error", error=req.error)
    return RequestOutput(req.request_id, req.prompt_text, req.prompt_ids, [sample], True)


def stop_engine(loop: SyncLoop | OverlapLoop, scheduler: Scheduler, error: BaseException) -> str:
    """Stop on a broken invariant: give up what is launched, end every request with the
    error (their outputs wait in the scheduler); returns the message."""
    message = f"engine stopped: {describe(error)}"
    log.error("%s", message, exc_info=error)
    loop.reset()
    scheduler.fail_all(message)
    return message
