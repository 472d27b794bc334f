"""Allocator of recurrent-state slots; slot 0 is the padding sink and is never handed out."""

from __future__ import annotations

import torch


class SlotAllocator:
    """Free list of state slots ``1..num_slots`` (slot 0 reserved as the padding sink)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots, 0, -1))
        self._is_free = bytearray(num_slots + 1)
        for s in self._free:
            self._is_free[s] = 1

    @property
    def capacity(self) -> int:
        return self.num_slots

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` free slots as an int64 tensor, or None when fewer are free."""
        if n > len(self._free):
            return None
        slots = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        for s in slots:
            self._is_free[s] = 0
        return torch.tensor(slots, dtype=torch.int64)

    def free(self, slots: torch.Tensor | list[int]) -> None:
        items = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        for s in items:
            if not 1 <= s <= self.num_slots:
                raise ValueError(f"free of state slot {s}: outside 1..{self.num_slots}")
            if self._is_free[s]:
                raise ValueError(f"double free of state slot {s}")
        for s in items:
            self._is_free[s] = 1
        self._free.extend(items)

    def check_invariants(self) -> None:
        if len(set(self._free)) != len(self._free) or sum(self._is_free) != len(self._free):
            raise AssertionError("slot allocator: free list and bitmap disagree")
