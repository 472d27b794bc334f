"""UHRC: the Unified Hybrid Radix Cache (tree core, components, typed params), and its
no-reuse mode (``NoReuseCache``)."""

from hyloop.cache.key import RadixKey
from hyloop.cache.node import FULL, RECURRENT, SWA, TreeNode
from hyloop.cache.params import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from hyloop.cache.unified import NoReuseCache, UnifiedRadixCache

__all__ = [
    "FULL",
    "RECURRENT",
    "SWA",
    "DecLockRefParams",
    "DecLockRefResult",
    "EvictParams",
    "EvictResult",
    "IncLockRefResult",
    "InsertParams",
    "InsertResult",
    "MatchPrefixParams",
    "MatchResult",
    "NoReuseCache",
    "RadixKey",
    "TreeNode",
    "UnifiedRadixCache",
]
