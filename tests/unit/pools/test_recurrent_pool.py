from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hyloop.pools.recurrent_pool import RecurrentPool, SlotRole
from hyloop.pools.step_fence import StepFence

TEMPORAL = (2, 3, 4)
CONV_DIM, KERNEL = 5, 4


def make_pool(
    num_slots: int = 6, num_layers: int = 3, fence: StepFence | None = None
) -> RecurrentPool:
    return RecurrentPool(num_layers, num_slots, TEMPORAL, CONV_DIM, KERNEL, fence=fence)


def fill_random(pool: RecurrentPool) -> None:
    gen = torch.Generator().manual_seed(0)
    for buf in pool.temporal + pool.conv:
        buf.copy_(torch.randn(buf.shape, generator=gen))


def test_shapes_and_sizes() -> None:
    pool = make_pool(num_slots=6, num_layers=3)
    assert [tuple(t.shape) for t in pool.temporal] == [(7, *TEMPORAL)] * 3
    assert [tuple(c.shape) for c in pool.conv] == [(7, CONV_DIM, KERNEL - 1)] * 3
    assert all(t.dtype == torch.float32 for t in pool.temporal)
    per_slot = 3 * 4 * (2 * 3 * 4 + 5 * 3)  # 3 layers of fp32: a temporal state and a conv tail
    assert pool.nbytes() == 7 * per_slot


def test_copy_slots_clones_every_layer_and_nothing_else() -> None:
    pool = make_pool()
    fill_random(pool)
    before = [b.clone() for b in pool.temporal + pool.conv]
    src, dst = torch.tensor([2, 5, 1]), torch.tensor([4, 3, 6])
    pool.copy_slots(src, dst)
    for old, new in zip(before, pool.temporal + pool.conv, strict=True):
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            assert torch.equal(new[d], old[s])
        for other in (0, 1, 2, 5):
            assert torch.equal(new[other], old[other])
    # A clone, not an alias: writing the destination leaves the source alone.
    pool.temporal[0][4].fill_(7.0)
    assert torch.equal(pool.temporal[0][2], before[0][2])


def test_copy_slots_swap_reads_before_writing() -> None:
    pool = make_pool()
    fill_random(pool)
    before = [b.clone() for b in pool.temporal + pool.conv]
    pool.copy_slots(torch.tensor([1, 2]), torch.tensor([2, 1]))
    for old, new in zip(before, pool.temporal + pool.conv, strict=True):
        assert torch.equal(new[1], old[2]) and torch.equal(new[2], old[1])


def test_copy_slots_rejects_bad_indices() -> None:
    pool = make_pool()
    with pytest.raises(ValueError, match="same length"):
        pool.copy_slots(torch.tensor([1, 2]), torch.tensor([3]))
    with pytest.raises(ValueError, match="duplicates"):
        pool.copy_slots(torch.tensor([1, 2]), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="outside 0..6"):
        pool.copy_slots(torch.tensor([9]), torch.tensor([3]))


def test_alloc_zeroes_and_zero_slots() -> None:
    pool = make_pool()
    fill_random(pool)
    slots = pool.alloc(2)
    assert slots is not None
    for buf in pool.temporal + pool.conv:
        assert torch.count_nonzero(buf[slots]) == 0
    pool.temporal[1][slots[0]].fill_(1.0)
    pool.zero_slots(slots[:1])
    assert torch.count_nonzero(pool.temporal[1][slots[0]]) == 0
    kept = pool.alloc(1, zero=False)
    assert kept is not None and torch.count_nonzero(pool.temporal[0][kept]) > 0


def test_roles_ledger_and_deferred_free() -> None:
    fence = StepFence()
    pool = make_pool(num_slots=6, fence=fence)
    active = pool.alloc(2)
    cow = pool.alloc(1, SlotRole.COW)
    tree = pool.alloc(2, SlotRole.TREE)
    assert active is not None and cow is not None and tree is not None
    pool.check_invariants(tree_held=2, active_held=3, track_held=0)
    pool.set_role(cow, SlotRole.ACTIVE)
    pool.set_role(active[:1], SlotRole.TRACK)
    assert pool.role_of(int(active[0])) is SlotRole.TRACK
    pool.check_invariants(tree_held=2, active_held=2, track_held=1)

    gen = fence.issue()  # a step is launched: what it may read must outlive it
    pool.release(tree[:1])
    assert pool.available_size() == 1  # still unavailable while a step may read it
    pool.check_invariants(tree_held=1)
    assert pool.counts()[SlotRole.PENDING_FREE] == 1
    fence.retire(gen)
    assert pool.available_size() == 2
    pool.check_invariants(tree_held=1)

    with pytest.raises(AssertionError, match="claim 2 tree"):
        pool.check_invariants(tree_held=2)
    with pytest.raises(AssertionError, match="claim 5 active"):
        pool.check_invariants(tree_held=1, active_held=5)
    assert pool.alloc(3) is None


def test_double_free_and_bad_roles() -> None:
    fence = StepFence()
    pool = make_pool(fence=fence)
    slots = pool.alloc(2)
    assert slots is not None
    pool.release(slots[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.release(slots[:1])
    gen = fence.issue()
    pool.release(slots[1:])
    with pytest.raises(ValueError, match="PENDING_FREE"):
        pool.release(slots[1:])
    fence.retire(gen)
    with pytest.raises(ValueError, match="double free"):
        pool.release(slots[1:])
    with pytest.raises(ValueError, match="set_role"):
        pool.set_role(slots[:1], SlotRole.TREE)
    with pytest.raises(ValueError, match="outside 1..6"):
        pool.release([0])
    with pytest.raises(ValueError, match="expected one of"):
        pool.alloc(1, SlotRole.FREE)
    with pytest.raises(ValueError, match="duplicates"):
        pool.release([3, 3])
    pool.check_invariants(tree_held=0, active_held=0)


HELD = [SlotRole.ACTIVE, SlotRole.COW, SlotRole.TREE, SlotRole.TRACK]


class PoolMachine(RuleBasedStateMachine):
    """The pool's ledger against a plain dict of slot -> role."""

    def __init__(self) -> None:
        super().__init__()
        self.fence = StepFence()
        self.pool = make_pool(num_slots=8, num_layers=1, fence=self.fence)
        self.model: dict[int, SlotRole] = {}
        self.pending: dict[int, int] = {}  # slot -> generation it waits for

    def _held(self) -> list[int]:
        return sorted(self.model)

    @rule(n=st.integers(0, 4), role=st.sampled_from(HELD))
    def alloc(self, n: int, role: SlotRole) -> None:
        free = 8 - len(self.model) - len(self.pending)
        slots = self.pool.alloc(n, role, zero=False)
        if n > free:
            assert slots is None
            return
        assert slots is not None
        got = slots.tolist()
        assert len(set(got)) == n and not set(got) & (set(self.model) | set(self.pending))
        self.model.update(dict.fromkeys(got, role))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), role=st.sampled_from(HELD))
    def set_role(self, data: st.DataObject, role: SlotRole) -> None:
        s = data.draw(st.sampled_from(self._held()))
        self.pool.set_role([s], role)
        self.model[s] = role

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self._held()))
        self.pool.release([s])
        if not self.fence.idle:  # a launched step may read it: it waits for the newest one
            self.pending[s] = self.fence.issued
        del self.model[s]

    @rule()
    def launch(self) -> None:
        self.fence.issue()

    @precondition(lambda self: not self.fence.idle)
    @rule(data=st.data())
    def retire(self, data: st.DataObject) -> None:
        gen = data.draw(st.integers(self.fence.retired + 1, self.fence.issued))
        self.fence.retire(gen)
        self.pending = {s: g for s, g in self.pending.items() if g > gen}

    @rule(s=st.integers(1, 8))
    def free_unheld_fails(self, s: int) -> None:
        if s not in self.model:
            with pytest.raises(ValueError, match="double free"):
                self.pool.release([s])

    @invariant()
    def ledger(self) -> None:
        tree = sum(r is SlotRole.TREE for r in self.model.values())
        track = sum(r is SlotRole.TRACK for r in self.model.values())
        active = len(self.model) - tree - track
        self.pool.check_invariants(tree_held=tree, active_held=active, track_held=track)
        assert self.pool.available_size() == 8 - len(self.model) - len(self.pending)
        for s, r in self.model.items():
            assert self.pool.role_of(s) is r


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
