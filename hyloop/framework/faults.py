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
(``pipeline.run_blocking``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hyloop.framework.outputs import CompletionOutput, RequestOutput
from hyloop.framework.requests import Status
from hyloop.pools import LedgerError

if TYPE_CHECKING:
    from hyloop.framework.loops import OverlapLoop
    from hyloop.framework.pipeline import SyncLoop
    from hyloop.framework.requests import Batch, Chunk, Request
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
    fail_all(scheduler, message)
    return message


def fail_all(scheduler: Scheduler, message: str) -> None:
    """The engine stops: every running and queued request ends with ``message``; what it
    holds is returned where the books still allow."""
    for req in [*scheduler.running, *scheduler.waiting]:
        req.error = message
        try:
            scheduler.finish(req, "error")
        except Exception:  # the ledger is broken: end it all the same, holding nothing
            log.exception("request %r: could not be released", req.request_id)
            req.lease, req.status, req.finish_reason = None, Status.FINISHED, "error"
            scheduler.forget(req)
    scheduler.running.clear()
    scheduler.waiting.clear()


def drop_chunk(scheduler: Scheduler, batch: Batch, chunk: Chunk, error: Exception) -> None:
    """``chunk``'s request failed while its step was prepared: it fails, and its chunk (and
    its track slot) leave the batch. A broken invariant gives up the whole step."""
    if is_engine_fault(error):
        scheduler.abandon(batch)
        raise error
    scheduler.fail(chunk.req, error)
    scheduler.cache.drop_track_slot(chunk.track_slot)
    chunk.track_slot = 0
    batch.chunks.remove(chunk)
