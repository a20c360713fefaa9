"""The RadixAttention prefix tree: pure Python, no MLX; cache data are opaque handles."""

from .misses import Miss, MissReason
from .tree import (
    Handle,
    LRUList,
    MatchResult,
    Node,
    NodeState,
    RadixTree,
    ReserveResult,
    ReserveStatus,
    Store,
    Stored,
    TreeStats,
)

__all__ = [
    "Handle",
    "LRUList",
    "MatchResult",
    "Miss",
    "MissReason",
    "Node",
    "NodeState",
    "RadixTree",
    "ReserveResult",
    "ReserveStatus",
    "Store",
    "Stored",
    "TreeStats",
]
