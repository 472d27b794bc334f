"""One request's chunks as a stream: ``for chunk in stream`` or ``async for chunk in stream``.

The engine loop (or the codec stage) ``put``\\ s chunks; the consumer takes them in order. Nothing
a consumer does blocks the producer: a stream buffers what its consumer has not taken yet (at
most its request's frames), so a slow consumer loses nothing and stalls no other request.
Leaving early aborts the request (its engine resources are returned by the loop): ``close()`` /
``aclose()``, a ``with`` / ``async with`` block ending, or the asyncio task that iterates it
ending before the final chunk (cancelled anywhere, returned or raised).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Any


class RequestStream:
    """The chunks of request ``request_id``; the last one has ``final=True``."""

    def __init__(
        self, request_id: str, abort: Callable[[str], None], ended: Callable[[str], None]
    ) -> None:
        self.request_id = request_id
        self._abort = abort
        self._on_end = ended
        self._lock = threading.Condition()
        self._items: deque[Any] = deque()
        self._event: asyncio.Event | None = None
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended = False  # the consumer took the final chunk, or left
        self._released = False  # ``ended`` was told (the engine forgets this stream)
        self.outcome: Any = None  # the final chunk once produced, taken or not
        self.max_buffered = 0  # the most chunks ever waiting (stats)

    # -- producer side (any thread) ---------------------------------------------------------------
    def put(self, chunk: Any) -> None:
        with self._lock:
            if not self._ended:
                self._items.append(chunk)
                self.max_buffered = max(self.max_buffered, len(self._items))
            loop, event = self._loop, self._event
        if chunk.final:
            self.outcome = chunk
            self._release()  # before anyone waiting on the outcome wakes
        with self._lock:
            self._lock.notify_all()
        if loop is not None and event is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)

    def _release(self) -> None:
        """Tell the engine once both the final chunk was produced and the consumer is done."""
        with self._lock:
            if self._released or not self._ended or self.outcome is None:
                return
            self._released = True
        self._on_end(self.request_id)

    # -- consumer side ----------------------------------------------------------------------------
    def _take(self) -> Any:
        chunk = self._items.popleft()
        if chunk.final:
            self._ended = True
            self._items.clear()
        return chunk

    def get(self, timeout: float | None = None) -> Any:
        """The next chunk, waiting for it (``TimeoutError`` after ``timeout`` seconds)."""
        with self._lock:
            if self._ended:
                raise StopIteration
            if not self._lock.wait_for(lambda: bool(self._items), timeout):
                raise TimeoutError(f"request {self.request_id!r}: no chunk in {timeout} s")
            chunk = self._take()
        self._release()
        return chunk

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> Any:
        return self.get()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Any:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is not None and task is not self._task:
            # The consuming task ending (returned, raised, or cancelled anywhere in its body)
            # before the final chunk aborts the request.
            self._task = task
            task.add_done_callback(lambda _: self.close())
        while True:
            with self._lock:
                if self._ended:
                    raise StopAsyncIteration
                chunk = self._take() if self._items else None
                if chunk is None:
                    if self._loop is not loop:
                        self._loop, self._event = loop, asyncio.Event()
                    event = self._event
                    assert event is not None
                    event.clear()
            if chunk is not None:
                self._release()
                return chunk
            try:
                await event.wait()
            except asyncio.CancelledError:
                self.close()
                raise

    def close(self) -> None:
        """Stop consuming; a request that has not ended is aborted (its final chunk, with
        ``finish_reason="abort"``, still lands in ``outcome``)."""
        with self._lock:
            ended, self._ended = self._ended, True
            self._items.clear()
        if not ended and self.outcome is None:
            self._abort(self.request_id)
        self._release()

    def wait(self, timeout: float | None = None) -> Any:
        """The final chunk, waiting for it to be produced (consumed or not)."""
        with self._lock:
            if not self._lock.wait_for(lambda: self.outcome is not None, timeout):
                raise TimeoutError(f"request {self.request_id!r}: not finished in {timeout} s")
            return self.outcome

    async def aclose(self) -> None:
        self.close()

    @property
    def finished(self) -> bool:
        return self._ended

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
