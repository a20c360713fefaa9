"""RadixAttention prefix tree over token ids.

Every cached prompt and completion lives on a path from the root; a node's edge is a run of
token ids and its handle is the opaque cache data for that run. The tree never looks inside
a handle: it asks for its size, whether and where it splits, and frees it through a callback.

Two kinds of handle share this tree (one kind per tree):

- splittable handles are spans: a node's handle covers exactly its edge tokens, and the
  state of a prefix is the concatenation of the handles along its path. Any prefix can be
  reused, so a match that ends inside an edge splits the node there.
- unsplittable handles are snapshots: the whole state after the node's last token. Only a
  node's end can be reused. The tree still splits such nodes for topology; the head then
  becomes a *junction* with no handle, which a match walks through but never returns.

Concurrency is optimistic (docs/ARCHITECTURE.md): one lock guards topology
and is held only to inspect or change it. A request that finds its remainder missing
reserves a PENDING node, computes outside the lock and publishes with `finalize` (or
`poison` on failure). Requests that reach a PENDING node wait on it (blocking with
`Node.wait`, or without blocking via `Node.add_done_callback`) and then match again, since
the topology may have changed while they waited. Handles are freed and callbacks run only
after the lock is released, because both may do heavy work or re-enter the tree.

Eviction pops least recently used evictable leaves (READY, unpinned, childless) from an
intrusive doubly linked list in O(1), cascading to parents that become evictable leaves.

Two tiers, when the tree is given a `Store` (the disk): a node with data in memory holds it
in `handle`, and may also hold a disk copy in `stored`, queued by the store when the handle
was published (write-through, so a restart finds what memory held). Memory eviction then
*demotes* a node with a copy instead of dropping it: it keeps its place, `on_disk`, with
only `stored`. Disk nodes form the bottom of the tree (a disk node's children are disk
nodes), so memory eviction works on memory leaves (no memory children) and disk eviction
on disk leaves, each from its own LRU list. A match walks into disk nodes and reports them
(`MatchResult.disk`); the caller loads their data, `promote`s them and matches again.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from radix.misses import BRANCH_TOKENS, Departures, Miss, MissReason
from radix.stats import stat

log = logging.getLogger("radix_mlx.radix")


class Handle(Protocol):
    """What the tree needs from the cache data a node owns."""

    nbytes: int
    splittable: bool

    def split(self, at: int) -> tuple[Handle, Handle]:
        """Return (first `at` tokens, the rest); the tree never frees `self` afterwards."""
        ...


class Stored(Protocol):
    """A node's data on disk, as the tree sees it: a size and the content key it is
    filed under (a key names one token path, so equal keys mean the same file)."""

    nbytes: int
    key: str


class Store(Protocol):
    """The disk tier. Its methods are called under the tree's lock and must neither block
    nor re-enter the tree: they only queue work for the store's own thread."""

    capacity_bytes: int
    root_key: str

    def key(self, parent_key: str, tokens: tuple[int, ...]) -> str:
        """The content key of `tokens` following the state named `parent_key`."""
        ...

    def save(self, key: str, parent_key: str, start: int, tokens: tuple[int, ...],
             handle: Handle) -> Stored | None:
        """Queue a disk copy of `handle` (tokens [start, start + len(tokens)) of its path);
        None when it cannot be queued now (the node then stays memory-only)."""
        ...

    def discard(self, stored: Stored) -> None:
        """Delete a copy (called outside the lock, like `free`)."""
        ...


class NodeState(enum.Enum):
    READY = "ready"
    PENDING = "pending"
    POISONED = "poisoned"


class _Link:
    """The intrusive part of an LRU list element; the list's sentinel is a bare `_Link`."""

    __slots__ = ("lru_next", "lru_owner", "lru_prev")

    def __init__(self) -> None:
        self.lru_prev: _Link | None = None
        self.lru_next: _Link | None = None
        self.lru_owner: LRUList | None = None


class Node(_Link):
    """One edge of the tree and the cache data for it.

    `pins` counts the pins on this node and on every node below it, so a node is
    pinned exactly when some request still needs its data. `handle` is the data in
    memory, `stored` a copy on disk; `on_disk` nodes have only the latter.
    `memory_children` counts the children that are not on disk (pending ones included).
    """

    __slots__ = (
        "_callbacks",
        "_mutex",
        "children",
        "error",
        "handle",
        "key",
        "last_access",
        "memory_children",
        "on_disk",
        "parent",
        "pins",
        "state",
        "stored",
        "tokens",
    )

    def __init__(
        self,
        tokens: tuple[int, ...],
        parent: Node | None,
        handle: Handle | None,
        mutex: threading.Lock,
    ) -> None:
        super().__init__()
        self.tokens = tokens
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.handle = handle
        self.stored: Stored | None = None
        self.on_disk = False
        self.key: str | None = None  # content key, once the node has been saved
        self.memory_children = 0
        self.pins = 0
        self.last_access = 0
        self.state = NodeState.READY
        self.error: BaseException | None = None
        # Only a PENDING node has waiters; None marks "done" for add_done_callback.
        self._callbacks: list[Callable[[Node], None]] | None = None
        self._mutex = mutex

    @property
    def nbytes(self) -> int:
        return self.handle.nbytes if self.handle is not None else 0

    @property
    def stateful(self) -> bool:
        """Holds data in some tier; a node that does not is a junction."""
        return self.handle is not None or self.stored is not None

    def add_done_callback(self, fn: Callable[[Node], None]) -> None:
        """Call `fn(node)` once the node is READY or POISONED; at once if it already is.

        This is how a single engine loop defers a request instead of sleeping.
        """
        with self._mutex:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise the creator's error if the node was poisoned."""
        finished = threading.Event()
        self.add_done_callback(lambda _: finished.set())
        if not finished.wait(timeout):
            raise TimeoutError(f"pending node not done after {timeout} s")
        if self.error is not None:
            raise self.error

    def path_tokens(self) -> tuple[int, ...]:
        """All tokens from the root to the end of this node."""
        parts = []
        with self._mutex:  # a concurrent split rewrites tokens and parent together
            node: Node | None = self
            while node is not None:
                parts.append(node.tokens)
                node = node.parent
        return tuple(itertools.chain.from_iterable(reversed(parts)))

    def __repr__(self) -> str:
        head = ", ".join(map(str, self.tokens[:6])) + (", ..." if len(self.tokens) > 6 else "")
        tier = "disk" if self.on_disk else "memory"
        return (
            f"Node([{head}] len={len(self.tokens)} {self.state.value} {tier} "
            f"pins={self.pins} nbytes={self.nbytes})"
        )


class LRUList:
    """Intrusive doubly linked list of nodes, least recently used first; O(1) operations."""

    def __init__(self) -> None:
        self._sentinel = _Link()
        self._sentinel.lru_prev = self._sentinel.lru_next = self._sentinel
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, node: Node) -> bool:
        return node.lru_owner is self

    def __iter__(self) -> Iterator[Node]:
        link = self._sentinel.lru_next
        while link is not self._sentinel:
            assert isinstance(link, Node)
            yield link
            link = link.lru_next

    def push_mru(self, node: Node) -> None:
        self._link(node, self._sentinel.lru_prev, self._sentinel)

    def push_lru(self, node: Node) -> None:
        self._link(node, self._sentinel, self._sentinel.lru_next)

    def remove(self, node: Node) -> None:
        assert node.lru_owner is self, f"{node!r} is not in this list"
        node.lru_prev.lru_next = node.lru_next
        node.lru_next.lru_prev = node.lru_prev
        node.lru_prev = node.lru_next = node.lru_owner = None
        self._len -= 1

    def pop_lru(self) -> Node:
        node = self._sentinel.lru_next
        assert isinstance(node, Node), "pop from an empty LRU list"
        self.remove(node)
        return node

    def _link(self, node: Node, before: _Link, after: _Link) -> None:
        assert node.lru_owner is None, "node is already in an LRU list"
        node.lru_prev, node.lru_next, node.lru_owner = before, after, self
        before.lru_next = after.lru_prev = node
        self._len += 1


@dataclass
class MatchResult:
    """The longest reusable cached prefix of a query."""

    node: Node
    """Deepest READY node with a handle whose whole path matched (the root if none)."""
    length: int
    """Tokens matched: the depth of `node`."""
    in_flight: Node | None = None
    """Another request's reservation (a PENDING node) the rest of the query continues
    into: wait on it, then match again."""
    in_flight_shared: int = 0
    """Query tokens after `length` that the in-flight node's path covers (0 if none)."""
    disk: list[Node] = field(default_factory=list)
    """Disk nodes with data that the query continues into, top first: load each one's
    `stored` data, `promote` it in this order, then match again."""
    disk_length: int = 0
    """Tokens matched once `disk` is promoted (0 if `disk` is empty)."""


class ReserveStatus(enum.Enum):
    CREATED = "created"
    """`node` is a new PENDING node, pinned for you: compute it, then finalize or poison."""
    WAIT = "wait"
    """`node` is another request's PENDING node on your path: wait on it, then match again."""
    RETRY = "retry"
    """The topology changed since your match: match again (`node` is the parent)."""


@dataclass(frozen=True)
class ReserveResult:
    status: ReserveStatus
    node: Node


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


class _Usage:
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


# Where a common prefix ends inside a long run, tokens are compared this many at a time
# at C speed up to the slice that differs, then one by one. Measured with
# `python -m bench.prefix_bench` (8k-32k tokens, differing at 10, 1000 or 3/4 of the way):
# as fast as comparing one by one where the prefix ends early, up to 1.9x faster where it
# ends late, and 1.3-7x faster than bisecting on slice comparisons (which copies a slice
# per step); the same as both on a whole match.
PREFIX_CHUNK = 64


def common_prefix_length(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of `a` and `b[start:]` (both lists or both tuples).
    A whole match, the common case on a cache hit, is one C-speed comparison."""
    n = min(len(a), len(b) - start)
    if a[:n] == b[start : start + n]:
        return n
    i = 0  # a[:n] differs from b[start:start + n], so both loops stop before n
    while a[i : i + PREFIX_CHUNK] == b[start + i : start + i + PREFIX_CHUNK]:
        i += PREFIX_CHUNK
    while a[i] == b[start + i]:
        i += 1
    return i


class RadixTree:
    """Thread-safe radix tree of cached token prefixes with a byte budget per tier.

    Accounting covers READY nodes only (a PENDING node has no data yet): a node's bytes and
    edge tokens count in the memory tier while it is not on disk, and in the disk tier
    while it has a copy there; in each they are *pinned* while `pins > 0` and
    *evictable* otherwise, so `evictable + pinned == total` per tier at every step. The
    root never counts and is never evicted.

    `store` (the disk tier) may be set once, before the tree is shared.
    """

    def __init__(self, capacity_bytes: int, free: Callable[[Handle], None],
                 store: Store | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.store = store
        self._free = free
        self._mutex = threading.Lock()
        self._clock = itertools.count(1)
        self.root = Node((), None, None, self._mutex)
        self.lru = LRUList()
        self.disk_lru = LRUList()
        self._memory, self._disk = _Usage(), _Usage()
        self._nodes = self._disk_nodes = self._pending = 0
        self._hits = self._misses = self._hit_tokens = self._evictions = 0
        self._disk_hits = self._disk_hit_tokens = self._disk_evictions = self._demotions = 0
        self.departures = Departures()
        # What the current critical section dropped, freed once the lock is released.
        self._garbage: list[Handle] = []
        self._discarded: list[Stored] = []

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The mutex, then free what was dropped under it."""
        with self._mutex:
            yield
            garbage, self._garbage = self._garbage, []
            discarded, self._discarded = self._discarded, []
        for handle in garbage:
            self._free(handle)
        for stored in discarded:
            self.store.discard(stored)

    # -- reading ---------------------------------------------------------------------

    def match(self, tokens: Sequence[int], *, pin: bool = False) -> MatchResult:
        """Find the longest reusable cached prefix of `tokens` and mark its path used.

        With `pin=True` the result node is pinned in the same critical section, so no
        other thread can evict it before the caller pins it (caller unpins). Disk nodes
        the query continues into are reported in `disk`, not matched (see `promote`).
        """
        tokens = tuple(tokens)
        with self._locked():  # a split deletes the copy of the span it cuts
            path, result = self._walk(tokens, split=True)
            self._touch(path)
            if result.length:
                self._hits += 1
                self._hit_tokens += result.length
            else:
                self._misses += 1
            if pin:
                self._pin_path(result.node)
        return result

    def peek(self, tokens: Sequence[int]) -> int:
        """How many tokens `match` would reuse (disk nodes promoted), without splitting,
        touching the LRU or counting a hit: for ordering a queue by cached prefix."""
        with self._mutex:
            result = self._walk(tuple(tokens), split=False)[1]
        return max(result.length, result.disk_length)

    def explain_miss(self, tokens: Sequence[int], reused: int) -> Miss | None:
        """Why `tokens[reused]` was not reused by a match that reused `reused` tokens
        (None when nothing was missed). Call it before reserving the rest: a request's
        own reservation would read as IN_FLIGHT."""
        tokens = tuple(tokens)
        if reused >= len(tokens):
            return None
        with self._mutex:
            node, depth, branch = self.root, 0, ()
            in_flight = snapshots = False  # what lies past `reused` on the path
            while depth < len(tokens):
                child = node.children.get(tokens[depth])
                if child is None:
                    if node.children:  # the most recently used branch
                        branch = max(node.children.values(), key=lambda n: n.last_access).tokens
                    break
                k = common_prefix_length(child.tokens, tokens, depth)
                if depth + k > reused:
                    data = child.handle if child.handle is not None else child.stored
                    in_flight |= child.state is NodeState.PENDING
                    snapshots |= data is None or not data.splittable
                if k < len(child.tokens):
                    branch, depth = child.tokens[k:], depth + k
                    break
                node, depth = child, depth + k
            if depth > reused:  # the tokens are there, but not as state to start from
                return Miss(reused, MissReason.NO_SNAPSHOT if snapshots and not in_flight
                            else MissReason.IN_FLIGHT)
            gone = self.departures.reason(tokens[:reused + 1])
            if gone is not None:
                return Miss(reused, gone)
            if branch:
                return Miss(reused, MissReason.DIVERGED, branch[:BRANCH_TOKENS])
            return Miss(reused, MissReason.NOT_SEEN)

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

    # -- pinning ---------------------------------------------------------------------

    def pin(self, node: Node) -> None:
        """Pin `node` and its ancestors: none of them can be evicted until `unpin`.

        `node` holds state (a `match` or `insert` result, or a disk node being loaded) or
        is the root: a junction may be reserved and replaced, so it is never pinned alone.
        """
        assert node is self.root or node.stateful, f"pin of a junction {node!r}"
        with self._mutex:
            self._pin_path(node)

    def pin_if_attached(self, node: Node) -> bool:
        """`pin`, unless `node` left the tree since it was seen (then False): for a disk
        node a match reported, which nothing pins until its loader does."""
        with self._mutex:
            if not self._attached(node):
                return False
            self._pin_path(node)
            return True

    def unpin(self, node: Node) -> None:
        """Release one pin taken by `pin` (or by `match(pin=True)` / `insert(pin=True)`)."""
        with self._mutex:
            self._unpin_path(node, 1)

    # -- writing ---------------------------------------------------------------------

    def reserve(self, parent: Node, tokens: Sequence[int]) -> ReserveResult:
        """Reserve the computation of `tokens` below `parent` without blocking.

        `parent` is the node of a fresh match, pinned by the caller. See `ReserveStatus`
        for the three outcomes. A CREATED node's edge is all of `tokens`, except with
        snapshot handles, where the walk may pass junctions that cover a head of them, and
        the reservation may be an existing junction (which keeps its children).
        """
        tokens = tuple(tokens)
        if not tokens:
            raise ValueError("reserve needs at least one token")
        with self._locked():
            if not self._attached_parent(parent):  # evicted since the match: pin it next time
                return ReserveResult(ReserveStatus.RETRY, parent)
            node, depth = parent, 0
            while True:
                child = node.children.get(tokens[depth])
                if child is None:
                    created = self._add_child(node, tokens[depth:], None)
                    return ReserveResult(ReserveStatus.CREATED, self._mark_pending(created))
                if child.state is NodeState.PENDING:
                    return ReserveResult(ReserveStatus.WAIT, child)
                k = common_prefix_length(child.tokens, tokens, depth)
                # A child whose state a match could have reused (or loaded) means the
                # caller's match is stale: someone published this prefix meanwhile.
                data = child.handle if child.handle is not None else child.stored
                if data is not None and (k == len(child.tokens) or data.splittable):
                    return ReserveResult(ReserveStatus.RETRY, parent)
                if k < len(child.tokens):
                    child = self._split(child, k)
                self._to_memory(child)
                node, depth = child, depth + k
                if depth == len(tokens):  # the tokens end on a junction: reserve filling it
                    return ReserveResult(ReserveStatus.CREATED, self._mark_pending(node))

    def finalize(self, node: Node, handle: Handle) -> None:
        """Publish the data of a PENDING node and wake its waiters.

        The node stays pinned by its creator, who unpins it when done with it.
        """
        with self._locked():
            if node.state is not NodeState.PENDING:
                raise ValueError(f"finalize of a {node.state.value} node")
            node.state = NodeState.READY
            node.handle = handle
            node.last_access = next(self._clock)
            self._pending -= 1
            self._add_stats(node, +1)
            self._sync_lru(node)
            self._save(node)
            callbacks, node._callbacks = node._callbacks, None
        self._run_callbacks(node, callbacks)

    def poison(self, node: Node, error: BaseException) -> None:
        """Fail a PENDING node: remove it, drop its creator's pin, wake waiters with `error`.

        A reserved junction leaves a fresh junction in its place, for its children. The
        creator must not unpin the node afterwards (it still unpins its parent).
        """
        with self._mutex:
            if node.state is not NodeState.PENDING:
                raise ValueError(f"poison of a {node.state.value} node")
            node.state = NodeState.POISONED
            node.error = error
            self._pending -= 1
            parent = node.parent
            pins_below = sum(child.pins for child in node.children.values())
            own_pins = node.pins - pins_below
            if node.children:
                junction = Node(node.tokens, parent, None, self._mutex)
                junction.children, node.children = node.children, {}
                for child in junction.children.values():
                    child.parent = junction
                junction.memory_children = node.memory_children
                junction.pins, junction.last_access = pins_below, node.last_access
                parent.children[node.tokens[0]] = junction
                self._add_stats(junction, +1)
                self._sync_lru(junction)
            else:
                del parent.children[node.tokens[0]]
                parent.memory_children -= 1
            node.parent, node.pins = None, 0
            self._unpin_path(parent, own_pins)
            callbacks, node._callbacks = node._callbacks, None
        self._run_callbacks(node, callbacks)

    def insert(
        self, parent: Node, tokens: Sequence[int], handle: Handle, *, pin: bool = False
    ) -> Node:
        """Publish `handle`, computed for `tokens` below `parent` (pinned by the caller).

        Parts already cached in memory are kept and the matching head of `handle` is freed;
        parts only on disk take their piece of `handle` back into memory; a PENDING node on
        the way ends the insert and the rest of `handle` is freed. Returns the deepest node
        on the path of `tokens` that holds state (else `parent`), pinned if `pin=True`.
        """
        tokens = tuple(tokens)
        if not tokens:
            raise ValueError("insert needs at least one token")
        with self._locked():
            if not self._attached_parent(parent):
                raise ValueError(f"insert below an evicted node {parent!r}: pin the parent")
            node = self._insert(parent, tokens, handle)
            if pin:
                self._pin_path(node)
        return node

    # -- the disk tier -----------------------------------------------------------------

    def promote(self, node: Node, handle: Handle, source: Stored | None = None) -> None:
        """Put `node` back in memory with `handle`, its data loaded from `node.stored` (or
        `source`, the copy read) by the caller, who pinned it (`pin`) for the load.
        Promote a match's `disk` nodes top first: a node's parent must be in memory
        already. It counts as a disk hit. If another thread promoted the node (or cut it)
        since `source` was read, `handle` is freed instead."""
        with self._locked():
            assert self._attached(node), f"promote of a dropped node {node!r}"
            if not node.on_disk or node.stored is not (source or node.stored):
                self._garbage.append(handle)
                return
            assert node.stored is not None, f"promote of {node!r}"
            self._lift(node.parent)
            assert not node.parent.on_disk, f"promote below a disk node {node.parent!r}"
            self._add_stats(node, -1)
            node.handle, node.on_disk = handle, False
            self._add_stats(node, +1)
            node.parent.memory_children += 1
            self._sync_lru(node)
            self._sync_lru(node.parent)
            self._disk_hits += 1
            self._disk_hit_tokens += len(node.tokens)

    def restore_all(self, copies: Iterable[tuple[str, tuple[int, ...], Stored]]
                    ) -> tuple[int, list[Stored]]:
        """Rebuild the disk tier's nodes from the copies found on disk at start, each
        given as (the key of the copy it follows, or the store's root key; its tokens;
        the copy). Parents go before their children. Returns how many copies became
        nodes, and the copies that have no place (see `restore`; orphans too): delete
        those. Safe while requests use the tree, which is how a server starts."""
        children: dict[str, list[tuple[tuple[int, ...], Stored]]] = collections.defaultdict(
            list)
        for parent_key, tokens, stored in copies:
            children[parent_key].append((tuple(tokens), stored))
        places, queue = {self.store.root_key: self.root}, collections.deque([self.store.root_key])
        restored, rejected = 0, []
        while queue:
            parent_key = queue.popleft()
            # Shortest first: a snapshot taken at a message end hangs from the same node as
            # the longer one its node was split from, and must be in place before it.
            for tokens, stored in sorted(children.pop(parent_key, ()), key=lambda c: len(c[0])):
                node = self.restore(places[parent_key], tokens, stored)
                if node is None:
                    rejected.append(stored)
                    continue
                restored += node.stored is stored
                places[stored.key] = node
                queue.append(stored.key)
        rejected += [stored for orphans in children.values() for _, stored in orphans]
        return restored, rejected

    def restore(self, parent: Node, tokens: Sequence[int], stored: Stored) -> Node | None:
        """Add a disk node for a copy found on disk at start: `tokens` below `parent` (the
        root or an earlier `restore`'s node). Returns the node now holding a copy filed
        under `stored.key` (an existing one if it is the same copy), or None if the copy
        has no place (over budget, parent evicted, overlapping other data): delete it.

        A span's data is the KV of exactly its tokens, so its copy fits only an edge of
        exactly those tokens right below `parent`. Requests served while the tree is
        rebuilt may have cut the path differently: a copy hung below a node they made
        would hold positions that node's edge does not start at. A snapshot is the whole
        state at its end, so it fits there whatever edges lie between."""
        tokens = tuple(tokens)
        with self._mutex:
            if self.store is None or not self._attached(parent) or parent.state is not (
                    NodeState.READY):
                return None
            if self._disk.total_bytes + stored.nbytes > self.store.capacity_bytes:
                return None
            node, depth = parent, 0
            while depth < len(tokens):
                if depth and stored.splittable:
                    return None
                child = node.children.get(tokens[depth])
                if child is None:
                    created = self._add_child(node, tokens[depth:], None, on_disk=True)
                    self._add_stats(created, -1)
                    created.stored, created.key = stored, stored.key
                    self._add_stats(created, +1)
                    self._sync_lru(created)
                    return created
                k = common_prefix_length(child.tokens, tokens, depth)
                if child.state is not NodeState.READY or k < len(child.tokens):
                    return None
                node, depth = child, depth + k
            if node.stored is not None:
                return node if node.stored.key == stored.key else None
            if node.handle is None or node.key not in (None, stored.key):
                return None
            self._add_stats(node, -1)
            node.stored, node.key = stored, stored.key
            self._add_stats(node, +1)
            return node

    def drop(self, node: Node) -> None:
        """Remove an unpinned disk node and everything below it, e.g. when its copy turned
        out unreadable; its copies are deleted."""
        with self._locked():
            if not self._attached(node):
                return
            assert node.on_disk and node.pins == 0, f"drop of {node!r}"
            parent = node.parent
            self._remove_subtree(node, MissReason.UNREADABLE)
            self._sync_lru(parent)

    # -- eviction --------------------------------------------------------------------

    def evict(self, nbytes: int) -> int:
        """Free least recently used evictable memory leaves until `nbytes` are freed or
        none are left, keeping those with a disk copy on disk; returns the bytes freed."""
        if nbytes <= 0:
            return 0
        with self._locked():
            return self._evict(nbytes, demote=True)

    def enforce_capacity(self) -> int:
        """Evict down to the memory budget; returns the bytes freed."""
        with self._mutex:
            excess = self._memory.total_bytes - self.capacity_bytes
        return self.evict(excess)

    def evict_disk(self, nbytes: int) -> int:
        """Delete least recently used disk leaves until `nbytes` are freed; returns that."""
        with self._locked():
            return self._evict_disk(nbytes)

    def clear(self) -> int:
        """Drop everything that is not pinned, from both tiers (disk copies deleted);
        returns the memory bytes freed."""
        with self._locked():
            freed = self._evict(math.inf, demote=False)
            self._evict_disk(math.inf, MissReason.CLEARED)
        return freed

    # -- internals (caller holds the mutex) ----------------------------------------------

    def _attached(self, node: Node) -> bool:
        return node is self.root or node.parent is not None

    def _attached_parent(self, parent: Node) -> bool:
        assert parent.state is not NodeState.PENDING, f"{parent!r} cannot be a parent yet"
        return self._attached(parent)

    def _insert(self, parent: Node, tokens: tuple[int, ...], handle: Handle) -> Node:
        node, depth = parent, 0
        while True:
            child = node.children.get(tokens[depth])
            if child is None:
                created = self._add_child(node, tokens[depth:], handle)
                self._save(created)
                return created
            if child.state is NodeState.PENDING:
                self._garbage.append(handle)
                while node is not parent and node.handle is None:  # junctions hold nothing
                    node = node.parent
                return node
            k = common_prefix_length(child.tokens, tokens, depth)
            if k < len(child.tokens):
                if child.on_disk and child.stored is not None and child.stored.splittable:
                    # Our data covers its head; it cannot be cut on disk, so it stays whole.
                    self._garbage.append(handle)
                    return node
                child = self._split(child, k)
            node, depth = child, depth + k
            if depth == len(tokens):
                if node.handle is None:  # a junction or on disk: ours becomes its state
                    self._take(node, handle)
                else:
                    self._garbage.append(handle)
                return node
            if handle.splittable:
                cached, handle = handle.split(k)
                if node.handle is None:
                    self._take(node, cached)
                else:
                    self._garbage.append(cached)
            else:
                self._to_memory(node)

    def _take(self, node: Node, handle: Handle) -> None:
        """`handle`, computed for `node`'s tokens, becomes its data in memory."""
        self._lift(node.parent)
        self._add_stats(node, -1)
        if node.on_disk:
            node.on_disk = False
            node.parent.memory_children += 1
        node.handle = handle
        self._add_stats(node, +1)
        node.last_access = next(self._clock)
        self._sync_lru(node)
        self._sync_lru(node.parent)
        self._save(node)

    def _to_memory(self, node: Node) -> None:
        """Make a node on a write's path a memory node, so a memory node can hang below
        it: a junction moves for free; a snapshot on disk becomes a junction (the writer
        only has the state at its own end)."""
        if not node.on_disk:
            return
        self._lift(node.parent)
        self._add_stats(node, -1)
        if node.stored is not None:
            self._discarded.append(node.stored)
            node.stored = None
        node.on_disk = False
        self._add_stats(node, +1)
        node.parent.memory_children += 1
        self._sync_lru(node)
        self._sync_lru(node.parent)

    def _lift(self, node: Node) -> None:
        """Move the disk junctions above a node that is coming into memory up with it."""
        chain = []
        while node.on_disk:
            assert node.stored is None, f"{node!r} must be promoted first"
            chain.append(node)
            node = node.parent
        for junction in reversed(chain):
            self._to_memory(junction)

    def _save(self, node: Node) -> None:
        """Queue a disk copy of a memory node that has none, making room by disk LRU."""
        if self.store is None or node.handle is None or node.stored is not None:
            return
        capacity = self.store.capacity_bytes
        needed = self._disk.total_bytes + node.handle.nbytes - capacity
        if needed > 0 and self._evict_disk(needed) < needed:
            return
        anchor, span = self._anchor(node)
        parent_key = self._key(anchor)
        node.key = self.store.key(parent_key, span)
        stored = self.store.save(node.key, parent_key, self._depth(node) - len(span), span,
                                 node.handle)
        if stored is not None:
            self._add_stats(node, -1)
            node.stored = stored
            self._add_stats(node, +1)
            self._evict_disk(self._disk.total_bytes - capacity)  # the estimate was short

    def _anchor(self, node: Node) -> tuple[Node, tuple[int, ...]]:
        """The nearest ancestor holding state (or the root) and the tokens from its end
        to `node`'s: what a copy of `node` is filed under."""
        parts = [node.tokens]
        anchor = node.parent
        while anchor is not self.root and not anchor.stateful:
            parts.append(anchor.tokens)
            anchor = anchor.parent
        return anchor, tuple(itertools.chain.from_iterable(reversed(parts)))

    def _key(self, node: Node) -> str:
        """A node's content key: its anchor's key followed by its tokens."""
        if node is self.root:
            return self.store.root_key
        if node.key is None:
            anchor, span = self._anchor(node)
            node.key = self.store.key(self._key(anchor), span)
        return node.key

    def _tokens_to(self, node: Node) -> tuple[int, ...]:
        """All tokens from the root to the end of `node` (`Node.path_tokens`, whose lock
        the caller holds)."""
        parts = []
        while node is not self.root:
            parts.append(node.tokens)
            node = node.parent
        return tuple(itertools.chain.from_iterable(reversed(parts)))

    def _depth(self, node: Node) -> int:
        depth = 0
        while node is not self.root:
            depth += len(node.tokens)
            node = node.parent
        return depth

    def _walk(self, tokens: tuple[int, ...], split: bool) -> tuple[list[Node], MatchResult]:
        """The match of `tokens` and the path from the root to its node (root excluded).

        Without `split`, a match ending inside a splittable edge counts the tokens it
        shares but leaves the edge whole (and `node` is the node above it). Disk nodes
        are never split: one whose edge the query ends inside is reported whole.
        """
        node, depth = self.root, 0
        path: list[Node] = []
        result, matched_path = MatchResult(self.root, 0), 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            k = common_prefix_length(child.tokens, tokens, depth)
            if child.state is NodeState.PENDING:
                result.in_flight, result.in_flight_shared = child, depth - result.length + k
                break
            if child.on_disk:  # everything below is on disk too
                data = child.stored
                if k < len(child.tokens) and (data is None or not data.splittable):
                    break
                node, depth = child, depth + k
                if data is not None:
                    result.disk.append(child)
                    result.disk_length = depth
                if k < len(child.tokens):
                    break
                continue
            if k < len(child.tokens):
                if child.handle is None or not child.handle.splittable:
                    break
                if not split:
                    result.length = depth + k
                    break
                child = self._split(child, k)
            node, depth = child, depth + k
            path.append(node)
            # Junctions are walked through but never returned: they hold no state.
            if node.handle is not None:
                result.node, result.length, matched_path = node, depth, len(path)
        return path[:matched_path], result

    def _add_child(self, parent: Node, tokens: tuple[int, ...], handle: Handle | None,
                   on_disk: bool = False) -> Node:
        child = Node(tokens, parent, handle, self._mutex)
        child.on_disk = on_disk
        child.last_access = next(self._clock)
        parent.children[tokens[0]] = child
        if not on_disk:
            parent.memory_children += 1
        self._add_stats(child, +1)
        self._sync_lru(parent)
        self._sync_lru(child)
        return child

    def _mark_pending(self, junction: Node) -> Node:
        """Turn a junction into its creator's PENDING reservation, pinned for the creator.

        Until finalize or poison, matches stop at it and its waiters queue on it.
        """
        self._add_stats(junction, -1)
        junction.state = NodeState.PENDING
        junction._callbacks = []
        self._pending += 1
        self._pin_path(junction)
        return junction

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node`'s edge after `at` tokens; the new head node is returned and `node`
        keeps the tail, so references held to `node` still mean the same position.

        A span's halves are new data, so its disk copy is deleted and each half is
        saved anew; a snapshot stays whole with the tail, copy and key included."""
        spans = node.handle is not None and node.handle.splittable
        assert not (node.on_disk and node.stored is not None and node.stored.splittable), (
            f"split of a span on disk {node!r}")
        self._add_stats(node, -1)
        head_handle = None
        if spans:
            head_handle, node.handle = node.handle.split(at)
            if node.stored is not None:
                self._discarded.append(node.stored)
                node.stored = None
            node.key = None
        head = Node(node.tokens[:at], node.parent, head_handle, self._mutex)
        head.on_disk = node.on_disk
        head.memory_children = 0 if node.on_disk else 1
        # The head's subtree holds exactly the tail's pins.
        head.pins = node.pins
        head.last_access = node.last_access
        node.parent.children[node.tokens[0]] = head
        node.tokens = node.tokens[at:]
        node.parent = head
        head.children[node.tokens[0]] = node
        self._add_stats(head, +1)
        self._add_stats(node, +1)
        if spans:
            self._save(head)
            self._save(node)
        return head

    def _touch(self, path: list[Node]) -> None:
        now = next(self._clock)
        for node in path:
            node.last_access = now
        if path and path[-1] in self.lru:
            self.lru.remove(path[-1])
            self.lru.push_mru(path[-1])

    def _pin_path(self, node: Node) -> None:
        assert self._attached(node), f"pin of an evicted node {node!r}"
        while node is not self.root:
            if node.pins == 0:
                self._add_stats(node, -1)
                node.pins = 1
                self._add_stats(node, +1)
                self._sync_lru(node)
            else:
                node.pins += 1
            node = node.parent

    def _unpin_path(self, node: Node, pins: int) -> None:
        while node is not self.root:
            assert node.pins >= pins, f"unpin of an unpinned node {node!r}"
            if node.pins == pins:
                self._add_stats(node, -1)
                node.pins = 0
                self._add_stats(node, +1)
                self._sync_lru(node)
            else:
                node.pins -= pins
            node = node.parent

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

    def _evictable_leaf(self, node: Node) -> bool:
        """In memory, READY, unpinned, with no child in memory."""
        return (
            node is not self.root
            and node.parent is not None
            and node.state is NodeState.READY
            and node.pins == 0
            and not node.on_disk
            and node.memory_children == 0
        )

    def _disk_evictable(self, node: Node) -> bool:
        """On disk, READY, unpinned, childless."""
        return (
            node.parent is not None
            and node.on_disk
            and node.state is NodeState.READY
            and node.pins == 0
            and not node.children
        )

    def _sync_lru(self, node: Node) -> None:
        """Keep `node` in the LRU list of its tier exactly while it is evictable there; a
        node that becomes evictable is treated as just used."""
        target = (self.lru if self._evictable_leaf(node)
                  else self.disk_lru if self._disk_evictable(node) else None)
        if node.lru_owner is not target:
            if node.lru_owner is not None:
                node.lru_owner.remove(node)
            if target is not None:
                target.push_mru(node)

    def _evict(self, nbytes: float, demote: bool) -> int:
        freed = 0
        while freed < nbytes and self.lru:
            node = self.lru.pop_lru()
            freed += node.nbytes
            self._evictions += 1
            parent = node.parent
            # A span needs its parent's data, a snapshot only its path: without a copy of
            # its own, a snapshot's node can stay as a junction for its disk children.
            keeps_place = node.stored is not None or (node.children and (
                node.handle is None or not node.handle.splittable))
            if demote and keeps_place:
                self._add_stats(node, -1)
                if node.handle is not None:
                    self._garbage.append(node.handle)
                    node.handle = None
                node.on_disk = True
                self._add_stats(node, +1)
                parent.memory_children -= 1
                self._demotions += node.stored is not None
                self._sync_lru(node)
            else:
                self._remove_subtree(node, MissReason.EVICTED_MEMORY if demote
                                     else MissReason.CLEARED)
            # A match touches the whole path, so the parent was last used no later
            # than the child just evicted unless it was matched on its own since;
            # the LRU end keeps eviction O(1) at the cost of that rare case.
            if self._evictable_leaf(parent):
                self.lru.push_lru(parent)
        return freed

    def _evict_disk(self, nbytes: float, reason: MissReason = MissReason.EVICTED_DISK) -> int:
        freed = 0
        while freed < nbytes and self.disk_lru:
            node = self.disk_lru.pop_lru()
            if node.stored is not None:
                freed += node.stored.nbytes
                self._disk_evictions += 1
            parent = node.parent
            self._remove_subtree(node, reason)
            if self._disk_evictable(parent):
                self.disk_lru.push_lru(parent)
        return freed

    def _remove_subtree(self, node: Node, reason: MissReason) -> None:
        """Detach an unpinned node and everything below it, dropping their data; a miss
        where it began will say `reason` (below it, a match cannot get that far)."""
        parent = node.parent
        self.departures.record(self._tokens_to(parent) + node.tokens[:1], reason)
        del parent.children[node.tokens[0]]
        if not node.on_disk:
            parent.memory_children -= 1
        stack = [node]
        while stack:
            gone = stack.pop()
            assert gone.pins == 0 and gone.state is NodeState.READY, f"{gone!r}"
            stack.extend(gone.children.values())
            if gone.lru_owner is not None:
                gone.lru_owner.remove(gone)
            self._add_stats(gone, -1)
            if gone.handle is not None:
                self._garbage.append(gone.handle)
                gone.handle = None
            if gone.stored is not None:
                self._discarded.append(gone.stored)
                gone.stored = None
            gone.parent = None

    # -- outside the mutex ---------------------------------------------------------------

    @staticmethod
    def _run_callbacks(node: Node, callbacks: list[Callable[[Node], None]]) -> None:
        # One failing waiter must not keep the others asleep.
        for fn in callbacks:
            try:
                fn(node)
            except Exception:
                log.exception("done callback of %r failed", node)
