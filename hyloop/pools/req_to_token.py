"""The req->token table: one row of KV slot indices per running request."""

from __future__ import annotations

import torch

from hyloop.pools.step_fence import DeferredFrees, StepFence


class ReqToTokenPool:
    """``[max_requests + 1, max_context]`` int32: row ``r`` column ``p`` is the KV slot of
    position ``p`` of row ``r``'s request. The last row, for padding, stays all zeros (slot 0,
    the padding sink)."""

    def __init__(
        self,
        max_requests: int,
        max_context: int,
        device: torch.device | str,
        fence: StepFence | None = None,
    ) -> None:
        if max_requests < 1 or max_context < 1:
            raise ValueError("max_requests and max_context must be >= 1")
        self.max_requests = max_requests
        self.max_context = max_context
        self.table = torch.zeros(max_requests + 1, max_context, dtype=torch.int32, device=device)
        self.padding_row = max_requests
        self._free_rows: list[int] = list(range(max_requests - 1, -1, -1))
        # Rows freed while a launched step may read them wait for it (``StepFence``).
        self.fence = fence
        self._pending: DeferredFrees[int] = DeferredFrees()
        self._parked: set[int] = set()  # the rows in ``_pending``
        if fence is not None:
            fence.attach(self.flush_pending, self._pending)

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        """Free ``row`` now, or once the steps that may read it retire (``StepFence``)."""
        bad = not 0 <= row < self.max_requests or row in self._free_rows
        if bad or row in self._parked:
            raise ValueError(f"req_to_token: bad free of row {row}")
        gen = self.fence.defer_gen if self.fence is not None else None
        if gen is not None:
            self._pending.park(gen, row)
            self._parked.add(row)
        else:
            self._free_rows.append(row)

    def flush_pending(self, through: int | None = None) -> int:
        """Free pending rows of generations ``<= through`` (all when None)."""
        done = self._pending.take_through(through)
        self._parked.difference_update(done)
        self._free_rows.extend(done)
        return len(done)

    def pending_size(self) -> int:
        return len(self._pending)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start : start + slots.numel()] = slots.to(self.table.dtype)

    def check_invariants(self) -> None:
        if len(set(self._free_rows)) != len(self._free_rows):
            raise AssertionError("req_to_token: duplicate free row")
        if self._parked != set(self._pending.items()):
            raise AssertionError("req_to_token: parked rows and the pending list disagree")
        if bool(self.table[self.padding_row].any()):
            raise AssertionError("req_to_token: padding row was written")
