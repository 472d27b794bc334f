"""UHRC: the Unified Hybrid Radix Cache (tree core, components, typed params) and NoReuseCache."""

from hyloop.cache.key import RadixKey
from hyloop.cache.no_reuse import NoReuseCache
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
from hyloop.cache.protocol import PrefixCache
from hyloop.cache.unified import UnifiedRadixCache

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
    "PrefixCache",
    "RadixKey",
    "TreeNode",
    "UnifiedRadixCache",
]
