"""The RadixAttention prefix tree: pure Python, no MLX; cache data are opaque handles."""

from .tree import (
    Handle,
    InsertStatus,
    LRUList,
    MatchResult,
    Node,
    NodeState,
    PendingResult,
    RadixTree,
    TreeStats,
)

__all__ = [
    "Handle",
    "InsertStatus",
    "LRUList",
    "MatchResult",
    "Node",
    "NodeState",
    "PendingResult",
    "RadixTree",
    "TreeStats",
]
