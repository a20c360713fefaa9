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
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from radix.stats import stat

log = logging.getLogger("radix_mlx.radix")


class Handle(Protocol):
    """What the tree needs from the cache data a node owns."""

    nbytes: int
    splittable: bool

    def split(self, at: int) -> tuple[Handle, Handle]:
        """Return (first `at` tokens, the rest); the tree never frees `self` afterwards."""
        ...


class NodeState(enum.Enum):
    READY = "ready"
    PENDING = "pending"
    POISONED = "poisoned"


class _Link:
    """The intrusive part of an LRU list element; the list's sentinel is a bare `_Link`."""

    __slots__ = ("lru_next", "lru_prev")

    def __init__(self) -> None:
        self.lru_prev: _Link | None = None
        self.lru_next: _Link | None = None


class Node(_Link):
    """One edge of the tree and the cache data for it.

    `pins` counts the pins on this node and on every node below it, so a node is
    pinned exactly when some request still needs its data.
    """

    __slots__ = (
        "_callbacks",
        "_mutex",
        "children",
        "error",
        "handle",
        "last_access",
        "parent",
        "pins",
        "state",
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
        return (
            f"Node([{head}] len={len(self.tokens)} {self.state.value} "
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
        return node.lru_next is not None

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
        node.lru_prev.lru_next = node.lru_next
        node.lru_next.lru_prev = node.lru_prev
        node.lru_prev = node.lru_next = None
        self._len -= 1

    def pop_lru(self) -> Node:
        node = self._sentinel.lru_next
        assert isinstance(node, Node), "pop from an empty LRU list"
        self.remove(node)
        return node

    def _link(self, node: Node, before: _Link, after: _Link) -> None:
        assert node.lru_next is None, "node is already in the LRU list"
        node.lru_prev, node.lru_next = before, after
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


def _common_prefix(edge: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `edge` and `tokens[start:]`."""
    n = min(len(edge), len(tokens) - start)
    # A whole-edge match is the common case on a hit; compare it at C speed first.
    if edge[:n] == tokens[start : start + n]:
        return n
    i = 0
    while edge[i] == tokens[start + i]:
        i += 1
    return i


class RadixTree:
    """Thread-safe radix tree of cached token prefixes with a byte budget.

    Accounting covers READY nodes only (a PENDING node has no data yet): a node's bytes and
    edge tokens are *pinned* while `pins > 0` and *evictable* otherwise, so
    `evictable + pinned == total` at every step. The root never counts and is never evicted.
    """

    def __init__(self, capacity_bytes: int, free: Callable[[Handle], None]) -> None:
        self.capacity_bytes = capacity_bytes
        self._free = free
        self._mutex = threading.Lock()
        self._clock = itertools.count(1)
        self.root = Node((), None, None, self._mutex)
        self.lru = LRUList()
        self._evictable_bytes = self._pinned_bytes = self._total_bytes = 0
        self._evictable_tokens = self._pinned_tokens = self._total_tokens = 0
        self._nodes = self._pending = 0
        self._hits = self._misses = self._hit_tokens = self._evictions = 0

    # -- reading ---------------------------------------------------------------------

    def match(self, tokens: Sequence[int], *, pin: bool = False) -> MatchResult:
        """Find the longest reusable cached prefix of `tokens` and mark its path used.

        With `pin=True` the result node is pinned in the same critical section, so no
        other thread can evict it before the caller pins it (caller unpins).
        """
        tokens = tuple(tokens)
        with self._mutex:
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
        """How many tokens `match` would reuse, without splitting, touching the LRU or
        counting a hit: for ordering a queue by cached prefix."""
        with self._mutex:
            return self._walk(tuple(tokens), split=False)[1].length

    def stats(self) -> TreeStats:
        with self._mutex:
            return self._stats_locked()

    def _stats_locked(self) -> TreeStats:
        return TreeStats(
            total_bytes=self._total_bytes,
            evictable_bytes=self._evictable_bytes,
            pinned_bytes=self._pinned_bytes,
            total_tokens=self._total_tokens,
            evictable_tokens=self._evictable_tokens,
            pinned_tokens=self._pinned_tokens,
            nodes=self._nodes,
            pending=self._pending,
            hits=self._hits,
            misses=self._misses,
            hit_tokens=self._hit_tokens,
            evictions=self._evictions,
            capacity_bytes=self.capacity_bytes,
        )

    # -- pinning ---------------------------------------------------------------------

    def pin(self, node: Node) -> None:
        """Pin `node` and its ancestors: none of them can be evicted until `unpin`.

        `node` holds state (a `match` or `insert` result) or is the root: a junction may
        be reserved and replaced, so it is never pinned on its own.
        """
        assert node is self.root or node.handle is not None, f"pin of a junction {node!r}"
        with self._mutex:
            self._pin_path(node)

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
        with self._mutex:
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
                k = _common_prefix(child.tokens, tokens, depth)
                # A child whose state a match could have reused means the caller's match
                # is stale: someone published this prefix meanwhile.
                if child.handle is not None and (k == len(child.tokens) or child.handle.splittable):
                    return ReserveResult(ReserveStatus.RETRY, parent)
                if k < len(child.tokens):
                    child = self._split(child, k)
                node, depth = child, depth + k
                if depth == len(tokens):  # the tokens end on a junction: reserve filling it
                    return ReserveResult(ReserveStatus.CREATED, self._mark_pending(node))

    def finalize(self, node: Node, handle: Handle) -> None:
        """Publish the data of a PENDING node and wake its waiters.

        The node stays pinned by its creator, who unpins it when done with it.
        """
        with self._mutex:
            if node.state is not NodeState.PENDING:
                raise ValueError(f"finalize of a {node.state.value} node")
            node.state = NodeState.READY
            node.handle = handle
            node.last_access = next(self._clock)
            self._pending -= 1
            self._add_stats(node, +1)
            self._sync_lru(node)
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
                junction.pins, junction.last_access = pins_below, node.last_access
                parent.children[node.tokens[0]] = junction
                self._add_stats(junction, +1)
            else:
                del parent.children[node.tokens[0]]
            node.parent, node.pins = None, 0
            self._unpin_path(parent, own_pins)
            callbacks, node._callbacks = node._callbacks, None
        self._run_callbacks(node, callbacks)

    def insert(
        self, parent: Node, tokens: Sequence[int], handle: Handle, *, pin: bool = False
    ) -> Node:
        """Publish `handle`, computed for `tokens` below `parent` (pinned by the caller).

        Parts already cached are kept and the matching head of `handle` is freed; a PENDING
        node on the way ends the insert and the rest of `handle` is freed. Returns the
        deepest node on the path of `tokens` that holds state (else `parent`), pinned if
        `pin=True`.
        """
        tokens = tuple(tokens)
        if not tokens:
            raise ValueError("insert needs at least one token")
        garbage: list[Handle] = []
        with self._mutex:
            if not self._attached_parent(parent):
                raise ValueError(f"insert below an evicted node {parent!r}: pin the parent")
            node = self._insert(parent, tokens, handle, garbage)
            if pin:
                self._pin_path(node)
        self._free_all(garbage)
        return node

    # -- eviction --------------------------------------------------------------------

    def evict(self, nbytes: int) -> int:
        """Free least recently used evictable leaves until `nbytes` are freed or none are
        left; returns the bytes freed."""
        return self._evict(nbytes) if nbytes > 0 else 0

    def enforce_capacity(self) -> int:
        """Evict down to the byte budget; returns the bytes freed."""
        with self._mutex:
            excess = self._total_bytes - self.capacity_bytes
        return self.evict(excess)

    def clear(self) -> int:
        """Evict everything that is not pinned; returns the bytes freed."""
        return self._evict(math.inf)

    # -- internals (caller holds the mutex) ----------------------------------------------

    def _attached(self, node: Node) -> bool:
        return node is self.root or node.parent is not None

    def _attached_parent(self, parent: Node) -> bool:
        assert parent.state is not NodeState.PENDING, f"{parent!r} cannot be a parent yet"
        return self._attached(parent)

    def _insert(
        self, parent: Node, tokens: tuple[int, ...], handle: Handle, garbage: list[Handle]
    ) -> Node:
        node, depth = parent, 0
        while True:
            child = node.children.get(tokens[depth])
            if child is None:
                return self._add_child(node, tokens[depth:], handle)
            if child.state is NodeState.PENDING:
                garbage.append(handle)
                while node is not parent and node.handle is None:  # junctions hold nothing
                    node = node.parent
                return node
            k = _common_prefix(child.tokens, tokens, depth)
            if k < len(child.tokens):
                child = self._split(child, k)
            node, depth = child, depth + k
            if depth == len(tokens):
                if node.handle is None:  # a junction: ours becomes its state
                    self._add_stats(node, -1)
                    node.handle = handle
                    self._add_stats(node, +1)
                    node.last_access = next(self._clock)
                else:
                    garbage.append(handle)
                return node
            if handle.splittable:
                cached, handle = handle.split(k)
                garbage.append(cached)

    def _walk(self, tokens: tuple[int, ...], split: bool) -> tuple[list[Node], MatchResult]:
        """The match of `tokens` and the path from the root to its node (root excluded).

        Without `split`, a match ending inside a splittable edge counts the tokens it
        shares but leaves the edge whole (and `node` is the node above it).
        """
        node, depth = self.root, 0
        path: list[Node] = []
        result, matched_path = MatchResult(self.root, 0), 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            k = _common_prefix(child.tokens, tokens, depth)
            if child.state is NodeState.PENDING:
                result.in_flight, result.in_flight_shared = child, depth - result.length + k
                break
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

    def _add_child(self, parent: Node, tokens: tuple[int, ...], handle: Handle | None) -> Node:
        child = Node(tokens, parent, handle, self._mutex)
        child.last_access = next(self._clock)
        parent.children[tokens[0]] = child
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
        keeps the tail, so references held to `node` still mean the same position."""
        if node.handle is None:
            head_handle, tail_handle = None, None
        elif node.handle.splittable:
            head_handle, tail_handle = node.handle.split(at)
        else:  # a snapshot belongs to the node's end: the head becomes a junction
            head_handle, tail_handle = None, node.handle
        self._add_stats(node, -1)
        head = Node(node.tokens[:at], node.parent, head_handle, self._mutex)
        # The head's subtree holds exactly the tail's pins.
        head.pins = node.pins
        head.last_access = node.last_access
        node.parent.children[node.tokens[0]] = head
        node.tokens = node.tokens[at:]
        node.handle = tail_handle
        node.parent = head
        head.children[node.tokens[0]] = node
        self._add_stats(head, +1)
        self._add_stats(node, +1)
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
        nbytes, ntokens = sign * node.nbytes, sign * len(node.tokens)
        self._total_bytes += nbytes
        self._total_tokens += ntokens
        if node.pins:
            self._pinned_bytes += nbytes
            self._pinned_tokens += ntokens
        else:
            self._evictable_bytes += nbytes
            self._evictable_tokens += ntokens
        self._nodes += sign

    def _evictable_leaf(self, node: Node) -> bool:
        return (
            node is not self.root
            and node.parent is not None
            and node.state is NodeState.READY
            and node.pins == 0
            and not node.children
        )

    def _sync_lru(self, node: Node) -> None:
        """Keep `node` in the LRU list exactly while it is an evictable leaf; a node that
        becomes one is treated as just used."""
        evictable, listed = self._evictable_leaf(node), node in self.lru
        if evictable and not listed:
            self.lru.push_mru(node)
        elif listed and not evictable:
            self.lru.remove(node)

    def _evict(self, nbytes: float) -> int:
        freed = 0
        garbage: list[Handle] = []
        with self._mutex:
            while freed < nbytes and self.lru:
                node = self.lru.pop_lru()
                freed += node.nbytes
                self._add_stats(node, -1)
                self._evictions += 1
                if node.handle is not None:
                    garbage.append(node.handle)
                    node.handle = None
                parent = node.parent
                del parent.children[node.tokens[0]]
                node.parent = None
                # A match touches the whole path, so the parent was last used no later
                # than the child just evicted unless it was matched on its own since;
                # the LRU end keeps eviction O(1) at the cost of that rare case.
                if self._evictable_leaf(parent):
                    self.lru.push_lru(parent)
        self._free_all(garbage)
        return freed

    # -- outside the mutex ---------------------------------------------------------------

    def _free_all(self, handles: list[Handle]) -> None:
        for handle in handles:
            self._free(handle)

    @staticmethod
    def _run_callbacks(node: Node, callbacks: list[Callable[[Node], None]]) -> None:
        # One failing waiter must not keep the others asleep.
        for fn in callbacks:
            try:
                fn(node)
            except Exception:
                log.exception("done callback of %r failed", node)
