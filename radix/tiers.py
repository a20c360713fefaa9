"""The disk tier of the tree: a `Store` keeps copies of node data, memory eviction
demotes a node with a copy instead of dropping it, `promote` brings one back, and
`restore_all` rebuilds the disk nodes from the copies a store finds at start.

A node with data in memory holds it in `handle`, and may also hold a disk copy in
`stored`, queued by the store when the handle was published (write-through, so a restart
finds what memory held). A demoted node keeps its place, `on_disk`, with only `stored`.
Disk nodes form the bottom of the tree (a disk node's children are disk nodes), so memory
eviction works on memory leaves and disk eviction on disk leaves, each from its own LRU
list. A match walks into disk nodes and reports them (`MatchResult.disk`); the caller loads
their data, `promote`s them and matches again.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Protocol

from radix.misses import MissReason
from radix.node import Handle, LRUList, Node, NodeState, Stored
from radix.prefix import common_prefix_length


class RestoreLater(Exception):
    """A copy's path runs through a node a request is computing: it has its place once
    that node is done (or gone)."""


class PathState(Protocol):
    """A token path as the store names it: `key` depends on the path's tokens alone, not
    on the nodes it is cut into, so a split leaves the key of the tail's path as it was."""

    @property
    def key(self) -> str: ...

    def follow(self, tokens: tuple[int, ...]) -> PathState:
        """The state of this path followed by `tokens`."""
        ...


class Store(Protocol):
    """The disk tier. Its methods are called under the tree's lock and must neither block
    nor re-enter the tree: they only queue work for the store's own thread."""

    capacity_bytes: int
    root_key: str  # the key of the empty path, `root_state.key`
    root_state: PathState

    def save(self, key: str, after: PathState, start: int, tokens: tuple[int, ...],
             handle: Handle) -> Stored | None:
        """Queue a disk copy of `handle` (tokens [start, start + len(tokens)) of its path,
        which follow the path `after`; `key` is that of the path they end); None when it
        cannot be queued now (the node then stays memory-only)."""
        ...

    def discard(self, stored: Stored) -> None:
        """Delete a copy (called outside the lock, like `free`)."""
        ...

    def tail(self, stored: Stored, at: int) -> Stored:
        """Make a span's copy stand for its tokens from the `at`-th on, the same file
        (loading it gives their KV alone), and return it: a copy found at start whose
        first tokens the tree already holds in nodes of its own (`restore`)."""
        ...


class Tiers:
    """The disk tier's part of `RadixTree`: what moves data between memory and disk.
    Methods whose names start with `_` run under the tree's mutex; the topology and
    accounting they call are the other parts'."""

    store: Store | None
    root: Node
    disk_lru: LRUList

    def promote(self, node: Node, handle: Handle, source: Stored | None = None) -> None:
        """Put `node` back in memory with `handle`, its data loaded from `node.stored` (or
        `source`, the copy read) by the caller, who pinned it (`pin`) for the load.
        Promote a match's `disk` nodes top first: a node's parent must be in memory
        already. It counts as a disk hit, and makes room for itself in the memory budget
        (evicting what is not pinned), as an insert's caller does: the request that loads
        it may wait, or go, before it holds it. If another thread promoted the node (or
        cut it) since `source` was read, `handle` is freed instead."""
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
            self._evict(self._memory.total_bytes - self.capacity_bytes, demote=True)

    def restore_all(self, copies: Iterable[tuple[str, tuple[int, ...], Stored]]
                    ) -> tuple[int, list[Stored]]:
        """Rebuild the disk tier's nodes from the copies found on disk at start, each
        given as (the key of the copy it follows, or the store's root key; its tokens;
        the copy). Parents go before their children. Returns how many copies became
        nodes, and the copies that have no place (see `restore`; orphans too): delete
        those. Safe while requests use the tree, which is how a server starts; a copy
        whose path runs through a node a request is computing has no place here (the
        engine's thread waits for it: `restoring`)."""
        steps = self.restoring(copies)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def restoring(self, copies: Iterable[tuple[str, tuple[int, ...], Stored]],
                  patience: float = 0.0) -> Generator[bool, None, tuple[int, list[Stored]]]:
        """`restore_all`, pausing after each copy (yielding False): a thread that serves
        requests runs it a slice of time at a time (a tier of many files).

        A copy whose path runs through a node a request is computing (`RestoreLater`)
        waits, with the copies after it below the same node (shortest first, see below)
        and every copy below them: those were deleted, a third of a 2,017-file tier by
        one request that came during the rebuild. While every copy left waits, it yields
        True (let the engine step first); after `patience` seconds of that, what still
        waits has no place. A copy may also follow one that is not on the list but live
        in the tree: its file was written after the listing, by requests served meanwhile
        that cut the path elsewhere and saved the tail under its own key anew."""
        children: dict[str, list[tuple[tuple[int, ...], Stored]]] = collections.defaultdict(
            list)
        for parent_key, tokens, stored in copies:
            children[parent_key].append((tuple(tokens), stored))
        places, queue = {self.store.root_key: self.root}, collections.deque([self.store.root_key])
        restored, rejected = 0, []
        waiting: list[tuple[str, tuple[int, ...], Stored]] = []
        give_up: float | None = None
        while True:
            if not queue and not waiting and children:
                # Requests served meanwhile wrote copies under their tree's cuts: a file
                # listed may follow one written after the listing, whose node is live.
                queue.extend(self._places_of(set(children) - set(places), places))
            if not queue and not waiting:
                break
            if queue:
                parent_key = queue.popleft()
                # Shortest first: a snapshot taken at a message end hangs from the same node
                # as the longer one its node was split from, and must be in place before it.
                turn = [(parent_key, tokens, stored) for tokens, stored in
                        sorted(children.pop(parent_key, ()), key=lambda c: len(c[0]))]
            else:
                now = time.monotonic()
                give_up = give_up if give_up is not None else now + patience
                if now >= give_up:
                    rejected += [stored for _, _, stored in waiting]
                    break
                yield True
                turn, waiting = waiting, []
            for index, (parent_key, tokens, stored) in enumerate(turn):
                try:
                    node = self.restore(places[parent_key], tokens, stored)
                except RestoreLater:
                    waiting += turn[index:]
                    yield False
                    break
                yield False
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
        has no place (over budget, parent evicted, its key not that path's, overlapping
        other data): delete it, and so every copy below it. Raises RestoreLater where a
        node on the path is being computed.

        Requests served while the tree is rebuilt may have cut the copy's path at other
        places: the first chat after a restart goes on past a stored system prompt, or
        parts from it midway. A span's data is the KV of exactly its tokens, so a copy
        hung below a node they made would hold positions that node's edge does not start
        at: the tree's one wrong-KV bug. Instead the walk follows the edges the copy's
        tokens run through, splitting a memory edge where the copy ends or parts from
        it, and the node where the copy's tokens leave the tree (or the last one they
        fill, unless it has a copy of its own, of the same key) takes it as the rest of
        its span (`Store.tail`). A memory edge is split only on the engine's thread,
        where the rebuild runs this (`Scheduler.restore`). A snapshot is the whole
        state at its end, so it fits there whatever edges lie between; an edge it leaves
        midway (a sibling's, the junction above them kept no state) is split where they
        part. Only a span on disk cannot be cut: a copy parting inside one is refused."""
        tokens = tuple(tokens)
        with self._locked():  # a split here discards the copy of the edge it cuts
            if self.store is None or not self._attached(parent) or parent.state is not (
                    NodeState.READY):
                return None
            if self._disk.total_bytes + stored.nbytes > self.store.capacity_bytes:
                return None
            if self._path_state(parent).follow(tokens).key != stored.key:
                return None
            node, depth, start = parent, 0, 0  # `node`'s edge: tokens[start:depth]
            while depth < len(tokens):
                child = node.children.get(tokens[depth])
                if child is None:
                    created = self._add_child(node, tokens[depth:], None, on_disk=True)
                    return self._take_copy(created, self._rest(stored, depth))
                if child.state is not NodeState.READY:
                    raise RestoreLater
                k = common_prefix_length(child.tokens, tokens, depth)
                if k < len(child.tokens):
                    if not self._cuttable(child, stored):
                        return None
                    # A memory span's head is saved anew: where the copy ends there, the
                    # same path, so the same key and file, and its memory's own bits.
                    child = self._split(child, k)
                node, depth, start = child, depth + k, depth
            if node.stored is not None:
                return node if node.stored.key == stored.key else None
            if node.key not in (None, stored.key) or node.handle is None and not node.on_disk:
                return None
            return self._take_copy(node, self._rest(stored, start))

    def _take_copy(self, node: Node, stored: Stored) -> Node:
        """`node` holding `stored` as its disk copy, filed under its key."""
        self._add_stats(node, -1)
        node.stored, node.key = stored, stored.key
        self._add_stats(node, +1)
        self._sync_lru(node)
        return node

    def _rest(self, stored: Stored, skip: int) -> Stored:
        """`stored` for a node whose edge starts `skip` tokens into the copy's span."""
        return self.store.tail(stored, skip) if skip and stored.splittable else stored

    @staticmethod
    def _cuttable(child: Node, stored: Stored) -> bool:
        """Whether `restore` may split `child`'s edge for the copy: any edge but a span
        on disk (its file cannot be cut), and for a span's copy only a memory span's, whose
        head then holds the copy's tokens there in memory."""
        if stored.splittable:
            return not child.on_disk and child.handle is not None and child.handle.splittable
        return not (child.on_disk and child.stored is not None and child.stored.splittable)

    def memory_keys(self) -> list[str]:
        """The keys of the disk copies of what memory holds, most recently used first:
        what a stop records, so that the next process of this model can bring the same
        state back into memory (`holding`, `disk_chain`)."""
        with self._mutex:
            nodes = [node for node in self._below_root() if node.state is NodeState.READY
                     and not node.on_disk and node.stored is not None]
            nodes.sort(key=lambda node: node.last_access, reverse=True)
            return [node.stored.key for node in nodes]

    def holding(self, keys: Iterable[str]) -> list[Node]:
        """The disk nodes holding the copies filed under `keys`, in their order; keys no
        disk node holds are left out."""
        with self._mutex:
            found = {node.stored.key: node for node in self._below_root()
                     if node.on_disk and node.stored is not None}
            return [found[key] for key in keys if key in found]

    def disk_chain(self, node: Node) -> list[Node]:
        """What loading `node` back into memory takes: the disk nodes with data from the
        top of its disk path down to it, top first (a match's `disk`); empty once it is
        in memory or gone."""
        with self._mutex:
            if not self._attached(node) or not node.on_disk or node.stored is None:
                return []
            chain = []
            while node.on_disk:
                if node.stored is not None:
                    chain.append(node)
                node = node.parent
            return chain[::-1]

    def departures_at_stop(self) -> list[tuple[int, str]]:
        """The record of what this tree let go of, plus what a stop is about to lose (the
        state held in memory only), for the next process of this model to explain its
        misses with (`Departures.extend`)."""
        with self._mutex:
            stack = [(self.root, ())]
            while stack:
                node, path = stack.pop()
                for child in node.children.values():
                    if child.state is NodeState.READY and child.handle is not None and (
                            child.stored is None):
                        self.departures.record(path + child.tokens[:1], MissReason.RELOADED)
                    else:
                        stack.append((child, path + child.tokens))
            return self.departures.entries()

    def remember_departures(self, entries: list[tuple[int, str]]) -> None:
        """Take back a record `departures_at_stop` gave an earlier process."""
        with self._mutex:
            self.departures.extend(entries)

    def drop(self, node: Node) -> None:
        """Remove an unpinned disk node and everything below it, e.g. when its copy turned
        out unreadable; its copies are deleted."""
        with self._locked():
            if not self._attached(node):
                return
            assert node.on_disk and node.pins == 0, f"drop of {node!r}"
            self._drop_unreadable(node)

    def forget_copies(self, copies: Iterable[Stored]) -> None:
        """The store could not write `copies` (a full disk). A node in memory keeps its
        data without a copy; a node on disk, its only data gone, goes with its subtree, as
        an unreadable one does (one pinned for a load is left to fail it). Either way the
        copy no longer counts in the disk tier's bytes, whose budget would otherwise make
        room for it by evicting copies that are there."""
        failed = {id(stored) for stored in copies}
        with self._locked():
            for node in [node for node in self._below_root()
                         if node.stored is not None and id(node.stored) in failed]:
                if not self._attached(node):  # below one dropped already
                    continue
                if not node.on_disk:
                    self._add_stats(node, -1)
                    node.stored = None
                    self._add_stats(node, +1)
                elif node.pins == 0:
                    self._drop_unreadable(node)

    def _drop_unreadable(self, node: Node) -> None:
        """`node`, on disk with no data to load, goes with its subtree."""
        parent = node.parent
        self._remove_subtree(node, MissReason.UNREADABLE)
        self._sync_lru(parent)

    def _places_of(self, keys: set[str], places: dict[str, Node]) -> list[str]:
        """Add to `places` the ready nodes holding copies filed under `keys`; their keys."""
        with self._mutex:
            found = {node.key: node for node in self._below_root()
                     if node.key in keys and node.state is NodeState.READY}
        places.update(found)
        return list(found)

    def _below_root(self) -> Iterator[Node]:
        """Every node of the tree but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

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
        self._change_tier(node, on_disk=False)
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
        after = self._path_state(anchor)
        stored = self.store.save(self._key(node), after, self._depth(node) - len(span), span,
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
        """A node's content key: that of its whole path."""
        return self._path_state(node).key

    def _path_state(self, node: Node) -> PathState:
        """The store's state of a node's whole path, kept on the node once computed."""
        if node is self.root:
            return self.store.root_state
        if node.path_state is None:
            anchor, span = self._anchor(node)
            node.path_state = self._path_state(anchor).follow(span)
            node.key = node.path_state.key
        return node.path_state

    def _depth(self, node: Node) -> int:
        depth = 0
        while node is not self.root:
            depth += len(node.tokens)
            node = node.parent
        return depth

    def _demote(self, node: Node) -> None:
        """Memory eviction of a node that keeps its place: its memory data goes, a disk
        copy (if any) stays, and it joins the disk nodes at the bottom of the tree."""
        self._change_tier(node, on_disk=True)
        self._demotions += node.stored is not None

    def _change_tier(self, node: Node, on_disk: bool) -> None:
        """Move `node` to the other tier with its stats, its parent's count of memory
        children and its LRU list, dropping what the new tier does not keep: its handle
        on the way to disk, its disk copy on the way back (see `_to_memory`)."""
        self._add_stats(node, -1)
        if on_disk and node.handle is not None:
            self._garbage.append(node.handle)
            node.handle = None
        elif not on_disk and node.stored is not None:
            self._discarded.append(node.stored)
            node.stored = None
        node.on_disk = on_disk
        self._add_stats(node, +1)
        node.parent.memory_children += -1 if on_disk else 1
        self._sync_lru(node)

    def _disk_evictable(self, node: Node) -> bool:
        """On disk, READY, unpinned, childless."""
        return (
            node.parent is not None
            and node.on_disk
            and node.state is NodeState.READY
            and node.pins == 0
            and not node.children
        )

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
