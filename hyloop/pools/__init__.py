"""Memory pools: paged KV (full and sliding-window), the req->token table and the
recurrent-state pool."""

from hyloop.pools.kv_pool import KVPool
from hyloop.pools.ledger import LedgerError
from hyloop.pools.page_allocator import PageAllocator, ReqToTokenPool
from hyloop.pools.recurrent_pool import RecurrentPool, SlotRole
from hyloop.pools.slot_allocator import SlotAllocator
from hyloop.pools.step_fence import DeferredFrees, StepFence
from hyloop.pools.swa_pool import SWAKVPool, SWAWindows

__all__ = [
    "DeferredFrees",
    "KVPool",
    "LedgerError",
    "PageAllocator",
    "RecurrentPool",
    "ReqToTokenPool",
    "SlotAllocator",
    "SlotRole",
    "StepFence",
    "SWAKVPool",
    "SWAWindows",
]
