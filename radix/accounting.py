"""The tree's accounting: bytes and tokens per tier, pinned or evictable, and the
hit, miss and eviction counters, kept incrementally and read as one `TreeStats`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from radix.node import Node, NodeState
from radix.stats import stat

if TYPE_CHECKING:
    from radix.tiers import Store


@dataclass(frozen=True)
class TreeStats:
    """The tree's accounting, in bytes and tokens of READY nodes, and its counters."""

    total_bytes: int = stat("gauge", "Bytes of KV held by the radix tree.", name="tree_bytes")
    evictable_bytes: int = stat("gauge", "Tree bytes no running request pins.",
                                name="tree_evictable_bytes")
    pinned_bytes: int = stat("gauge", "Tree bytes pinned by running requests.",
                             name="tree_pinned_bytes")
    total_tokens: int = stat("gauge", "Tokens held by the radix tree.", name="tree_tokens")
    evictable_tokens: int = stat("gauge", "Tree tokens no running request pins.",
                                 name="tree_evictable_tokens")
    pinned_tokens: int = stat("gauge", "Tree tokens pinned by running requests.",
                              name="tree_pinned_tokens")
    nodes: int = stat("gauge", "Nodes in the radix tree (junctions included).",
                      name="tree_nodes")
    pending: int = stat("gauge", "Tree nodes reserved and still being computed.",
                        name="tree_pending_nodes")
    hits: int = stat("counter", "Radix matches that reused cached tokens.", name="cache_hits")
    misses: int = stat("counter", "Radix matches that found nothing.", name="cache_misses")
    hit_tokens: int = stat("counter", "Tokens reused by radix matches.",
                           name="cache_hit_tokens")
    evictions: int = stat("counter", "Radix tree nodes evicted.", name="tree_evictions")
    capacity_bytes: int = stat("gauge", "The radix tree's byte budget.",
                               name="tree_capacity_bytes")
    disk_bytes: int = stat("gauge", "Bytes of KV copies in the disk tier.")
    disk_evictable_bytes: int = stat("gauge", "Disk tier bytes nothing is loading.")
    disk_pinned_bytes: int = stat("gauge", "Disk tier bytes pinned while being loaded.")
    disk_tokens: int = stat("gauge", "Tokens with a copy in the disk tier.")
    disk_evictable_tokens: int = stat("gauge", "Disk tier tokens nothing is loading.")
    disk_pinned_tokens: int = stat("gauge", "Disk tier tokens pinned while being loaded.")
    disk_nodes: int = stat("gauge", "Tree nodes with a copy in the disk tier.")
    disk_capacity_bytes: int = stat("gauge", "The disk tier's byte budget (0: no disk tier).")
    disk_hits: int = stat("counter", "Tree nodes loaded back from the disk tier.")
    disk_hit_tokens: int = stat("counter", "Tokens loaded back from the disk tier.")
    disk_evictions: int = stat("counter", "Disk tier copies deleted to make room.")
    disk_demotions: int = stat("counter", "Memory evictions that kept the node on disk.")


class Usage:
    """Bytes and tokens of one tier, split into pinned and evictable."""

    def __init__(self) -> None:
        self.pinned_bytes = self.evictable_bytes = 0
        self.pinned_tokens = self.evictable_tokens = 0

    def add(self, nbytes: int, ntokens: int, pinned: bool, sign: int) -> None:
        if pinned:
            self.pinned_bytes += sign * nbytes
            self.pinned_tokens += sign * ntokens
        else:
            self.evictable_bytes += sign * nbytes
            self.evictable_tokens += sign * ntokens

    @property
    def total_bytes(self) -> int:
        return self.pinned_bytes + self.evictable_bytes

    @property
    def total_tokens(self) -> int:
        return self.pinned_tokens + self.evictable_tokens


class Accounting:
    """The bookkeeping part of `RadixTree`. Counts cover READY nodes only (a PENDING node
    has no data yet): a node's bytes and edge tokens count in the memory tier while it is
    not on disk, and in the disk tier while it has a copy there; in each they are *pinned*
    while `pins > 0` and *evictable* otherwise, so `evictable + pinned == total` per tier
    at every step. The root never counts."""

    capacity_bytes: int
    store: Store | None

    def _init_accounting(self) -> None:
        self._memory, self._disk = Usage(), Usage()
        self._nodes = self._disk_nodes = self._pending = 0
        self._hits = self._misses = self._hit_tokens = self._evictions = 0
        self._disk_hits = self._disk_hit_tokens = self._disk_evictions = self._demotions = 0

    def stats(self) -> TreeStats:
        with self._mutex:
            return self._stats_locked()

    def _stats_locked(self) -> TreeStats:
        memory, disk = self._memory, self._disk
        return TreeStats(
            total_bytes=memory.total_bytes,
            evictable_bytes=memory.evictable_bytes,
            pinned_bytes=memory.pinned_bytes,
            total_tokens=memory.total_tokens,
            evictable_tokens=memory.evictable_tokens,
            pinned_tokens=memory.pinned_tokens,
            nodes=self._nodes,
            pending=self._pending,
            hits=self._hits,
            misses=self._misses,
            hit_tokens=self._hit_tokens,
            evictions=self._evictions,
            capacity_bytes=self.capacity_bytes,
            disk_bytes=disk.total_bytes,
            disk_evictable_bytes=disk.evictable_bytes,
            disk_pinned_bytes=disk.pinned_bytes,
            disk_tokens=disk.total_tokens,
            disk_evictable_tokens=disk.evictable_tokens,
            disk_pinned_tokens=disk.pinned_tokens,
            disk_nodes=self._disk_nodes,
            disk_capacity_bytes=self.store.capacity_bytes if self.store else 0,
            disk_hits=self._disk_hits,
            disk_hit_tokens=self._disk_hit_tokens,
            disk_evictions=self._disk_evictions,
            disk_demotions=self._demotions,
        )

    def _add_stats(self, node: Node, sign: int) -> None:
        """Add (+1) or remove (-1) a node's bytes and tokens under its current state."""
        if node.state is not NodeState.READY:
            return
        pinned = node.pins > 0
        self._nodes += sign
        if not node.on_disk:
            self._memory.add(node.nbytes, len(node.tokens), pinned, sign)
        if node.stored is not None:
            self._disk.add(node.stored.nbytes, len(node.tokens), pinned, sign)
            self._disk_nodes += sign
