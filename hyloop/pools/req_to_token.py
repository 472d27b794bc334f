"""The req->token table: one row of KV slot indices per running request."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """``[max_requests + 1, max_context]`` int32 slot indices; the last row is the padding row.

    Row ``r`` column ``p`` holds the KV slot of position ``p`` of the request that owns row ``r``.
    The padding row stays all zeros (slot 0, the padding sink).
    """

    def __init__(self, max_requests: int, max_context: int, device: torch.device | str) -> None:
        if max_requests < 1 or max_context < 1:
            raise ValueError("max_requests and max_context must be >= 1")
        self.max_requests = max_requests
        self.max_context = max_context
        self.table = torch.zeros(max_requests + 1, max_context, dtype=torch.int32, device=device)
        self.padding_row = max_requests
        self._free_rows: list[int] = list(range(max_requests - 1, -1, -1))
        self._pending: list[tuple[int, int]] = []  # (generation, row) freed while a step reads it

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        if row in self._free_rows or not 0 <= row < self.max_requests:
            raise ValueError(f"req_to_token: bad free of row {row}")
        self._free_rows.append(row)

    def free_deferred(self, row: int, generation: int) -> None:
        if not 0 <= row < self.max_requests or row in self._free_rows:
            raise ValueError(f"req_to_token: bad free of row {row}")
        self._pending.append((generation, row))

    def flush_pending(self, through: int | None = None) -> int:
        done = [r for g, r in self._pending if through is None or g <= through]
        self._pending = [(g, r) for g, r in self._pending if not (through is None or g <= through)]
        for row in done:
            self.free(row)
        return len(done)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start : start + slots.numel()] = slots.to(self.table.dtype)

    def check_invariants(self) -> None:
        if len(set(self._free_rows)) != len(self._free_rows):
            raise AssertionError("req_to_token: duplicate free row")
        if bool(self.table[self.padding_row].any()):
            raise AssertionError("req_to_token: padding row was written")
