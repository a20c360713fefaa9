"""The RadixAttention prefix tree: pure Python, no MLX; cache data are opaque handles."""

from .accounting import TreeStats
from .misses import Miss, MissReason
from .node import Handle, LRUList, Node, NodeState, Stored
from .reservations import ReserveResult, ReserveStatus
from .tiers import Store
from .tree import MatchResult, RadixTree

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
