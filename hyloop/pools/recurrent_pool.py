"""Recurrent-state pool: per recurrent layer a temporal and a conv state per slot, plus slot roles.

A slot is the state of every recurrent layer (temporal ``[H, a, b]`` + conv ``[conv_dim, K - 1]``).
Slot 0 is the padding sink that padded rows of a captured step read and write, so index tensors
keep a fixed size. Every other slot has exactly one role at a time:

- FREE: in the allocator's free list;
- ACTIVE: a request's working state (a CoW destination becomes ACTIVE once filled);
- COW: a fresh slot being filled from a tree snapshot, owned by the request about to use it;
- TREE: a snapshot owned by a radix-tree node;
- TRACK: a snapshot being published at a track boundary (later handed to the tree);
- PENDING_FREE: released while a launched step may still read it; free once that step retires
  (``StepFence``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from hyloop.pools.slot_allocator import SlotAllocator
from hyloop.pools.step_fence import DeferredFrees, StepFence


class SlotRole(enum.IntEnum):
    FREE = 0
    ACTIVE = 1
    COW = 2
    TREE = 3
    TRACK = 4
    PENDING_FREE = 5


_HELD_ROLES = (SlotRole.ACTIVE, SlotRole.COW, SlotRole.TREE, SlotRole.TRACK)


def _as_list(slots: torch.Tensor | Sequence[int]) -> list[int]:
    return slots.tolist() if isinstance(slots, torch.Tensor) else [int(s) for s in slots]


class RecurrentPool:
    """State buffers of all recurrent layers plus the slot allocator and the role ledger.

    NOTE: buffers are separate per layer (like the KV pool) so a layer writes its own in place
    with ``index_copy_``; cross-layer operations loop over layers, never slots.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        temporal_shape: Sequence[int],
        conv_dim: int,
        conv_kernel: int,
        conv_dtype: torch.dtype = torch.float32,
        temporal_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fence: StepFence | None = None,
    ) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if conv_kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2, got {conv_kernel}")
        self.allocator = SlotAllocator(num_slots)
        self.num_slots = num_slots
        self.device = torch.device(device)
        rows = num_slots + 1  # + slot 0, the padding sink
        self.temporal = [
            torch.zeros((rows, *temporal_shape), dtype=temporal_dtype, device=self.device)
            for _ in range(num_layers)
        ]
        self.conv = [
            torch.zeros((rows, conv_dim, conv_kernel - 1), dtype=conv_dtype, device=self.device)
            for _ in range(num_layers)
        ]
        self._role = bytearray(rows)  # SlotRole per slot; slot 0 stays FREE and is never counted
        self.fence = fence
        self._pending: DeferredFrees[int] = DeferredFrees()
        if fence is not None:
            fence.attach(self.flush_pending, self._pending)

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.num_slots

    @property
    def num_layers(self) -> int:
        return len(self.temporal)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.temporal + self.conv)

    # -- roles ----------------------------------------------------------------------------------
    def alloc(
        self, n: int, role: SlotRole = SlotRole.ACTIVE, zero: bool = True
    ) -> torch.Tensor | None:
        """``n`` slots in ``role`` (zeroed unless ``zero=False``), or None when too few are free."""
        self._check_held_role(role)
        slots = self.allocator.alloc(n)
        if slots is None:
            return None
        for s in slots.tolist():
            self._role[s] = role
        if zero and n > 0:
            self.zero_slots(slots)
        return slots

    def set_role(self, slots: torch.Tensor | Sequence[int], role: SlotRole) -> None:
        """Move held slots to another held role (e.g. COW -> ACTIVE, TRACK -> TREE)."""
        self._check_held_role(role)
        items = _as_list(slots)
        for s in items:
            self._check_held(s, f"set_role({role.name})")
        for s in items:
            self._role[s] = role

    def role_of(self, slot: int) -> SlotRole:
        self._check_range(slot, "role_of")
        return SlotRole(self._role[slot])

    def release(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Free held slots: now, or as PENDING_FREE until the steps that may read them retire."""
        items = _as_list(slots)
        self._check_unique(items, "release")
        for s in items:
            self._check_held(s, "release")
        gen = self.fence.defer_gen if self.fence is not None else None
        if gen is not None:
            for s in items:
                self._role[s] = SlotRole.PENDING_FREE
                self._pending.park(gen, s)
            return
        self.allocator.free(items)
        for s in items:
            self._role[s] = SlotRole.FREE

    def free(self, slots: list[int]) -> None:
        """The tree's free of snapshots it held (evicted or duplicates): fenced like ``release``."""
        self.release(slots)

    def flush_pending(self, through: int | None = None) -> int:
        """Free pending slots of generations ``<= through`` (every one when None)."""
        done = self._pending.take_through(through)
        if not done:
            return 0
        self.allocator.free(done)
        for s in done:
            self._role[s] = SlotRole.FREE
        return len(done)

    def pending_size(self) -> int:
        return len(self._pending)

    def counts(self) -> dict[SlotRole, int]:
        """Slots per role over ``1..num_slots``."""
        out = dict.fromkeys(SlotRole, 0)
        for r in self._role[1:]:
            out[SlotRole(r)] += 1
        return out

    def check_invariants(
        self, tree_held: int, active_held: int | None = None, track_held: int | None = None
    ) -> None:
        """Check active + cow + tree + track + free + pending-free == capacity, and the owners'
        claims: ``tree_held`` always, ``active_held`` (working and CoW slots) and ``track_held``
        when given."""
        c = self.counts()
        self.allocator.check_invariants()
        if sum(c.values()) != self.capacity:
            raise AssertionError(f"recurrent pool: roles {c} do not sum to {self.capacity}")
        if c[SlotRole.FREE] != self.allocator.available_size():
            raise AssertionError(
                f"recurrent pool: {c[SlotRole.FREE]} slots marked free, allocator has "
                f"{self.allocator.available_size()}"
            )
        if c[SlotRole.PENDING_FREE] != len(self._pending):
            raise AssertionError(
                f"recurrent pool: {c[SlotRole.PENDING_FREE]} pending-free roles, "
                f"{len(self._pending)} in the pending list"
            )
        expected = [("tree", tree_held, c[SlotRole.TREE])]
        if active_held is not None:
            expected.append(("active", active_held, c[SlotRole.ACTIVE] + c[SlotRole.COW]))
        if track_held is not None:
            expected.append(("track", track_held, c[SlotRole.TRACK]))
        for name, claimed, held in expected:
            if claimed != held:
                raise AssertionError(
                    f"recurrent pool: owners claim {claimed} {name} slots, pool has {held}"
                )

    # -- state ops ------------------------------------------------------------------------------
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Clone the full state (every layer, temporal and conv) of ``src[i]`` into ``dst[i]``."""
        if src.dim() != 1 or src.shape != dst.shape:
            raise ValueError(
                f"copy_slots: src {tuple(src.shape)} and dst {tuple(dst.shape)}, expected two "
                "1-D index tensors of the same length"
            )
        self._check_unique(_as_list(dst), "copy_slots dst")
        for s in _as_list(src):
            self._check_range(s, "copy_slots src")
        for s in _as_list(dst):
            self._check_range(s, "copy_slots dst")
        src = src.to(self.device, torch.int64)
        dst = dst.to(self.device, torch.int64)
        for buf in self.temporal + self.conv:
            buf.index_copy_(0, dst, buf.index_select(0, src))

    def zero_slots(self, slots: torch.Tensor) -> None:
        """Reset the full state of ``slots`` (a fresh request starts from zeros)."""
        for s in _as_list(slots):
            self._check_range(s, "zero_slots")
        slots = slots.to(self.device, torch.int64)
        for buf in self.temporal + self.conv:
            buf.index_fill_(0, slots, 0)

    # -- checks ---------------------------------------------------------------------------------
    def _check_range(self, slot: int, op: str) -> None:
        if not 0 <= slot <= self.num_slots:
            raise ValueError(f"{op}: state slot {slot} outside 0..{self.num_slots}")

    def _check_held(self, slot: int, op: str) -> None:
        if not 1 <= slot <= self.num_slots:
            raise ValueError(f"{op}: state slot {slot} outside 1..{self.num_slots}")
        role = SlotRole(self._role[slot])
        if role not in _HELD_ROLES:
            raise ValueError(
                f"{op}: state slot {slot} is {role.name} (double free), expected a held slot"
            )

    @staticmethod
    def _check_held_role(role: SlotRole) -> None:
        if role not in _HELD_ROLES:
            names = ", ".join(r.name for r in _HELD_ROLES)
            raise ValueError(f"slot role {role!r}: expected one of {names}")

    @staticmethod
    def _check_unique(items: list[int], op: str) -> None:
        if len(set(items)) != len(items):
            raise ValueError(f"{op}: slots {items} contain duplicates")
