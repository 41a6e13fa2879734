"""Prefix cache: a preallocated KV slot pool and a radix tree over token ids (pure data structures)."""

from __future__ import annotations

from po_backend.engine.cache.kv_pool import KVPool
from po_backend.engine.cache.radix import (
    CacheInUseError,
    CacheStats,
    InsertResult,
    MatchResult,
    Node,
    RadixCache,
)

__all__ = ["CacheInUseError", "CacheStats", "InsertResult", "KVPool", "MatchResult", "Node", "RadixCache"]
