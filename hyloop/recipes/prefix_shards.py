"""Prefix-affinity sharding: rows that start alike go to one replica, under a load bound.

A row's key is a fingerprint of the first page-aligned block of its prompt tokens. Rows with
equal keys share at least that block, so the replica that serves them computes it once and its
radix cache serves the rest. Groups of equal keys are placed whole, largest first, each on the
least-loaded replica; a group that would push a replica past the bound fills it to the bound and
spills the rest onto the next least-loaded one. Within a replica, a group's rows run together.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def key_block(prefix_tokens: int, page_size: int) -> int:
    """Tokens the key covers: ``prefix_tokens`` rounded down to whole pages (one page at least),
    since the cache matches and shares whole pages only."""
    return max(page_size, prefix_tokens // page_size * page_size)


def prefix_key(ids: Sequence[int], block: int, page_size: int) -> int:
    """The fingerprint (a signed 64-bit int) of ``ids``' first ``block`` tokens; a shorter prompt
    is keyed by its whole pages, and one shorter than a page by all of it."""
    n = min(block, len(ids) // page_size * page_size) or len(ids)
    digest = hashlib.blake2b(np.asarray(ids[:n], dtype=np.int64).tobytes(), digest_size=8)
    return int.from_bytes(digest.digest(), "little", signed=True)


@dataclass(frozen=True)
class ShardPlan:
    """Where each row runs: ``order`` lists row indices replica by replica (``sizes[r]`` rows
    each), groups of equal keys contiguous; no replica holds more than ``cap`` rows."""

    order: np.ndarray
    sizes: tuple[int, ...]
    cap: int

    def replica_of(self) -> np.ndarray:
        """The replica of each row, indexed by row."""
        replica = np.empty(len(self.order), dtype=np.int64)
        replica[self.order] = np.repeat(np.arange(len(self.sizes)), self.sizes)
        return replica

    def position(self) -> np.ndarray:
        """Each row's place in ``order``, indexed by row."""
        position = np.empty(len(self.order), dtype=np.int64)
        position[self.order] = np.arange(len(self.order))
        return position


def imbalance_cap(num_rows: int, replicas: int, max_imbalance: float) -> int:
    """Most rows one replica may take: ``max_imbalance`` x the mean, rounded down, but never
    below an even split (``ceil(num_rows / replicas)``), which any placement needs."""
    return max(math.ceil(num_rows / replicas), math.floor(max_imbalance * num_rows / replicas))


def plan_shards(keys: np.ndarray, replicas: int, max_imbalance: float) -> ShardPlan:
    """Place rows (``keys[i]`` the key of row ``i``) on ``replicas`` replicas."""
    if replicas < 1:
        raise ValueError(f"replicas: got {replicas}; expected an int >= 1")
    if not max_imbalance >= 1.0:
        raise ValueError(f"max_imbalance: got {max_imbalance}; expected a float >= 1")
    keys = np.asarray(keys, dtype=np.int64)
    n = len(keys)
    cap = imbalance_cap(n, replicas, max_imbalance)
    if n == 0:
        return ShardPlan(order=keys, sizes=(0,) * replicas, cap=cap)
    _, first, inverse, counts = np.unique(
        keys, return_index=True, return_inverse=True, return_counts=True
    )
    # Rows grouped by key, input order kept inside a group; groups largest first, then by
    # their first row, so the plan depends on the rows alone.
    grouped = np.argsort(inverse, kind="stable")
    groups = np.split(grouped, np.cumsum(counts)[:-1])
    placed: list[list[np.ndarray]] = [[] for _ in range(replicas)]
    load = [0] * replicas
    for g in sorted(range(len(groups)), key=lambda g: (-counts[g], first[g])):
        rows = groups[g]
        while len(rows):
            # NOTE: the least-loaded replica always has room: were it full, all would be, and
            # replicas * cap >= n rows would already be placed.
            r = min(range(replicas), key=load.__getitem__)
            take = min(len(rows), cap - load[r])
            placed[r].append(rows[:take])
            load[r] += take
            rows = rows[take:]
    order = np.concatenate([part for shard in placed for part in shard])
    return ShardPlan(order=order.astype(np.int64), sizes=tuple(load), cap=cap)
