"""RadixAttention prefix tree over token ids: its topology and matching.

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

Concurrency is optimistic (docs/ARCHITECTURE.md): one lock guards topology and is held only
to inspect or change it. Handles are freed only after the lock is released, because freeing
may do heavy work or re-enter the tree.

Eviction pops least recently used evictable leaves (READY, unpinned, childless) from an
intrusive doubly linked list in O(1), cascading to parents that become evictable leaves.

`RadixTree` is one class made of four parts, one module each: this one (topology,
matching, pinning, memory eviction), `radix.reservations` (the write path of concurrent
requests), `radix.tiers` (the disk tier) and `radix.accounting` (bytes, tokens, counters).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from radix.accounting import Accounting
from radix.misses import BRANCH_TOKENS, Departures, Miss, MissReason
from radix.node import Handle, LRUList, Node, NodeState, Stored
from radix.prefix import common_prefix_length
from radix.reservations import Reservations
from radix.tiers import Store, Tiers


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


class RadixTree(Reservations, Tiers, Accounting):
    """Thread-safe radix tree of cached token prefixes with a byte budget per tier.

    The root holds no data and is never evicted; see `Accounting` for what the stats count.

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
        self._init_accounting()
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

    def continuation(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the whole of `tokens` in the tree (along the
        most recently used branch where it forks), or [] if `tokens` is not a path in it:
        what an earlier request sent or generated after this exact context, a free draft
        for speculative decoding. Reads token ids only, so any node serves (pending, on
        disk, a junction); touches nothing."""
        tokens = tuple(tokens)
        with self._mutex:
            node, depth, inside = self.root, 0, 0  # `inside`: tokens matched of node's edge
            while depth < len(tokens):
                child = node.children.get(tokens[depth])
                if child is None:
                    return []
                k = common_prefix_length(child.tokens, tokens, depth)
                node, depth, inside = child, depth + k, k
                if k < len(child.tokens) and depth < len(tokens):
                    return []
            found = list(node.tokens[inside:inside + limit])
            while len(found) < limit and node.children:
                node = max(node.children.values(), key=lambda child: child.last_access)
                found += node.tokens[:limit - len(found)]
        return found

    def explain_miss(self, tokens: Sequence[int], reused: int) -> Miss | None:
        """Why `tokens[reused]` was not reused by a match that reused `reused` tokens
        (None when nothing was missed). Call it before reserving the rest: a request's
        own reservation would read as IN_FLIGHT."""
        tokens = tuple(tokens)
        if reused >= len(tokens):
            return None
        if self.capacity_bytes == 0 and self.store is None:
            # What it held went at once: a departure there says evicted, which is not
            # why nothing is ever reused.
            return Miss(reused, MissReason.CACHE_OFF)
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

    # -- pinning ---------------------------------------------------------------------

    def pin(self, node: Node) -> None:
        """Pin `node` and its ancestors: none of them can be evicted until `unpin`.

        `node` holds state (a `match` or `insert` result, or a disk node being loaded) or
        is the root: a junction may be reserved and replaced, so it is never pinned alone.
        """
        assert node is self.root or node.stateful, f"pin of a junction {node!r}"
        with self._mutex:
            self._pin_path(node)

    def unpin(self, node: Node) -> None:
        """Release one pin taken by `pin` (or by `match(pin=True)` / `insert(pin=True)`)."""
        with self._mutex:
            self._unpin_path(node, 1)

    # -- writing ---------------------------------------------------------------------

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

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node`'s edge after `at` tokens; the new head node is returned and `node`
        keeps the tail, so references held to `node` still mean the same position.

        A span's halves are new data, so its disk copy is deleted and each half is
        saved anew: the tail under its old key (its path ends where the node's did, so
        the copies below it still name their parent), the head under a new one. A
        snapshot stays whole with the tail, copy and key included."""
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
                self._demote(node)
            else:
                self._remove_subtree(node, MissReason.EVICTED_MEMORY if demote
                                     else MissReason.CLEARED)
            # A match touches the whole path, so the parent was last used no later
            # than the child just evicted unless it was matched on its own since;
            # the LRU end keeps eviction O(1) at the cost of that rare case.
            if self._evictable_leaf(parent):
                self.lru.push_lru(parent)
        return freed

    def _remove_subtree(self, node: Node, reason: MissReason) -> None:
        """Detach an unpinned node and everything below it, dropping their data; a miss
        where it began will say `reason` (below it, a match cannot get that far)."""
        parent = node.parent
        self.departures.record(parent.path_tokens_locked() + node.tokens[:1], reason)
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
