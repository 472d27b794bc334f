"""Typed parameters and results of the UHRC operations.

A lock is released only by handing back the receipt ``inc_lock_ref`` returned. The cache keeps
its own record of what each receipt locked, so a forged or replayed receipt cannot decrement
someone else's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hyloop.cache.key import RadixKey
from hyloop.cache.node import TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class MatchPrefixParams:
    """``full_only`` matches on the FULL backbone alone (no SWA window or snapshot needed):
    a request re-matching its own freshly inserted prefix to read the tree's KV indices.
    ``approximate`` also walks nodes holding approximate KV (``TreeNode.approximate``), which
    an exact-prefix match stops before: only a request re-reading its own insert asks for it
    (``position_independent.exactness``)."""

    key: RadixKey
    full_only: bool = False
    approximate: bool = False


@dataclass(slots=True)
class MatchResult:
    """The reusable prefix of a key.

    Every component can serve the ``prefix_len`` hit tokens. ``last_node`` ends at
    ``prefix_len`` (lock this one); ``best_match_node`` is the deepest node where every component
    hits (the same node without a host tier). ``full_prefix_len`` (>= ``prefix_len``) is how far
    the FULL backbone alone matched. ``recurrent_slot``: the snapshot to copy-on-write from when
    ``recurrent_hit``. ``device_indices``: the hit prefix's KV slots, ``prefix_len`` long.
    """

    prefix_len: int
    last_node: TreeNode
    best_match_node: TreeNode
    full_prefix_len: int
    recurrent_hit: bool = False
    recurrent_slot: int | None = None
    device_indices: torch.Tensor = field(default_factory=lambda: _EMPTY)  # int64 KV slots


@dataclass(frozen=True, slots=True)
class InsertParams:
    """Insert ``key`` with the KV slot indices ``value`` (one per token).

    ``recurrent_slot``: the snapshot of the state after the whole key; the tree takes it only
    when the key length is a page multiple. ``swa_value`` (SWA with a pool of its own): each
    token's window-pool slot, valid from ``swa_from`` (a page multiple: what the caller still
    holds). The tree keeps the window before the key's end and fills window-less nodes it already
    had from ``swa_from`` on; ``InsertResult.swa_taken`` says which slots it took.
    ``approximate_from``: the KV of positions from here on is approximate (reused at another
    offset, or computed after such KV); new nodes there are marked ``approximate``, and the
    insert stops before a marked node it would fill with exact KV (None: all of it is exact).
    """

    key: RadixKey
    value: torch.Tensor
    recurrent_slot: int | None = None
    swa_value: torch.Tensor | None = None
    swa_from: int = 0
    approximate_from: int | None = None


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What the tree did with an insert.

    The tree already held ``value[:prefix_len]`` and freed the caller's differing copies; it owns
    ``value[prefix_len:aligned_len]``; the unaligned tail stays with the caller (and all from
    ``aligned_len == prefix_len`` on when it stopped before approximate KV). ``last_node``
    ends at ``aligned_len``: move the request's lock there. ``recurrent_taken``: the tree took the
    slot (stored, or freed as a duplicate when not ``recurrent_stored``); else the caller keeps it.
    """

    prefix_len: int
    aligned_len: int
    last_node: TreeNode
    num_freed: int = 0
    recurrent_taken: bool = False
    recurrent_stored: bool = False
    swa_taken: tuple[tuple[int, int], ...] = ()  # token ranges of swa_value the tree now owns


@dataclass(frozen=True, slots=True)
class EvictParams:
    """Evict at least ``num_tokens`` FULL tokens, ``swa_num_tokens`` SWA tokens and
    ``recurrent_num`` snapshots (each as far as unlocked data allows)."""

    num_tokens: int = 0
    swa_num_tokens: int = 0
    recurrent_num: int = 0


@dataclass(frozen=True, slots=True)
class EvictResult:
    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    recurrent_num_evicted: int = 0


@dataclass(frozen=True, slots=True)
class DecLockRefParams:
    receipt_id: int
    node_id: int


@dataclass(frozen=True, slots=True)
class IncLockRefResult:
    """A lock receipt. ``delta``: FULL tokens moved from evictable to protected;
    ``swa_start_depth``: the depth where the SWA window lock stops (None without SWA);
    ``recurrent_locked``: whether the node's snapshot was pinned."""

    receipt_id: int
    node: TreeNode
    delta: int
    swa_start_depth: int | None = None
    recurrent_locked: bool = False

    @property
    def node_id(self) -> int:
        return self.node.id

    def to_dec_params(self) -> DecLockRefParams:
        return DecLockRefParams(receipt_id=self.receipt_id, node_id=self.node.id)


@dataclass(frozen=True, slots=True)
class DecLockRefResult:
    """``delta``: FULL tokens moved back from protected to evictable."""

    delta: int
