"""Test doubles, an invariant checker, tree operations only tests need, and `acquire`
(the optimistic write loop for blocking threads) for tests that use the radix tree without
MLX."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from radix import Handle, MatchResult, Node, NodeState, RadixTree, ReserveStatus, Stored


class FakeHandle:
    """A handle that remembers which tokens it stands for and how often it was freed.

    `tokens` is the run it covers and `prefix` the tokens before it on its path, so a
    split's halves know their place. A snapshot (unsplittable) conventionally covers the
    whole path: `FakeHandle(path, splittable=False)`.
    """

    def __init__(
        self,
        tokens: Sequence[int],
        bytes_per_token: int = 1,
        splittable: bool = True,
        *,
        prefix: Sequence[int] = (),
        ledger: list[FakeHandle] | None = None,
    ) -> None:
        self.tokens = tuple(tokens)
        self.prefix = tuple(prefix)
        self.bytes_per_token = bytes_per_token
        self.splittable = splittable
        self.nbytes = len(self.tokens) * bytes_per_token
        self.freed = 0
        self.consumed = False
        self.ledger = ledger
        if ledger is not None:
            ledger.append(self)

    @property
    def path(self) -> tuple[int, ...]:
        return self.prefix + self.tokens

    def reread(self) -> FakeStored:
        """The copy as a new process finds it: its whole span (`FakeStore.tail` undone)."""
        path = self.path
        self.prefix, self.tokens = path[:len(path) - len(self.span)], self.span
        return self

    def split(self, at: int) -> tuple[FakeHandle, FakeHandle]:
        assert self.splittable, "split of an unsplittable handle"
        assert 0 < at < len(self.tokens), f"split at {at} of {len(self.tokens)} tokens"
        assert not self.consumed and not self.freed, "split of a dead handle"
        self.consumed = True
        kw = {"bytes_per_token": self.bytes_per_token, "ledger": self.ledger}
        head = FakeHandle(self.tokens[:at], prefix=self.prefix, **kw)
        tail = FakeHandle(self.tokens[at:], prefix=self.prefix + self.tokens[:at], **kw)
        return head, tail

    def free(self) -> None:
        assert not self.consumed, f"free of a handle consumed by split: {self!r}"
        assert not self.freed, f"double free: {self!r}"
        self.freed += 1

    def __repr__(self) -> str:
        kind = "span" if self.splittable else "snapshot"
        return f"FakeHandle({kind} {self.prefix}+{self.tokens})"


class FakeStored:
    """A disk copy of a `FakeHandle`: what it stood for, and how often it was deleted."""

    def __init__(self, handle: FakeHandle, key: str, parent_key: str = "",
                 span: tuple[int, ...] = ()) -> None:
        self.tokens, self.prefix = handle.tokens, handle.prefix
        # What a file's header says: the copy it follows and the tokens it was saved as.
        self.parent_key, self.span = parent_key, span
        self.splittable = handle.splittable
        self.bytes_per_token = handle.bytes_per_token
        self.nbytes = handle.nbytes
        self.key = key
        self.discarded = 0

    @property
    def path(self) -> tuple[int, ...]:
        return self.prefix + self.tokens

    def reread(self) -> FakeStored:
        """The copy as a new process finds it: its whole span (`FakeStore.tail` undone)."""
        path = self.path
        self.prefix, self.tokens = path[:len(path) - len(self.span)], self.span
        return self

    def load(self, ledger: list[FakeHandle] | None = None) -> FakeHandle | None:
        """The data back in memory, as a new handle; None once deleted (a file gone)."""
        if self.discarded:
            return None
        return FakeHandle(self.tokens, self.bytes_per_token, self.splittable,
                          prefix=self.prefix, ledger=ledger)

    def __repr__(self) -> str:
        return f"FakeStored({self.prefix}+{self.tokens} {self.key})"


class FakePathState:
    """A path as `FakeStore` names it: its tokens, whatever nodes hold them."""

    def __init__(self, path: tuple[int, ...] = ()) -> None:
        self.path = path

    @property
    def key(self) -> str:
        return "/".join(["root", *map(str, self.path)])

    def follow(self, tokens: tuple[int, ...]) -> FakePathState:
        return FakePathState(self.path + tuple(tokens))


class FakeStore:
    """A disk tier in a list: every copy it made, and whether it is `full` (then it
    refuses copies, like a store whose write queue is full)."""

    root_key = "root"
    root_state = FakePathState()

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.saved: list[FakeStored] = []
        self.full = False

    def save(self, key: str, after: FakePathState, start: int, tokens: tuple[int, ...],
             handle: FakeHandle) -> FakeStored | None:
        assert key == after.follow(tokens).key and len(after.path) == start
        parent_key = after.key
        assert handle.path[start:] == tokens and len(handle.path) == start + len(tokens), (
            f"{handle!r} saved as {start}+{tokens}")
        # A span's data is its own tokens' KV and no more, as a file of it will be.
        assert not handle.splittable or handle.tokens == tokens, f"{handle!r} saved as {tokens}"
        if self.full:
            return None
        stored = FakeStored(handle, key, parent_key, tokens)
        self.saved.append(stored)
        return stored

    def discard(self, stored: FakeStored) -> None:
        assert not stored.discarded, f"double delete of {stored!r}"
        stored.discarded += 1

    def tail(self, stored: FakeStored, at: int) -> FakeStored:
        assert stored.splittable and 0 < at < len(stored.tokens)
        stored.prefix, stored.tokens = stored.prefix + stored.tokens[:at], stored.tokens[at:]
        return stored

    def live(self) -> list[FakeStored]:
        return [s for s in self.saved if not s.discarded]


_COUNTED = (
    "total_bytes",
    "pinned_bytes",
    "evictable_bytes",
    "total_tokens",
    "pinned_tokens",
    "evictable_tokens",
    "nodes",
    "pending",
)
_TIERS = {"memory": lambda node: node.nbytes if not node.on_disk else None,
          "disk": lambda node: node.stored.nbytes if node.stored is not None else None}


def check_invariants(tree: RadixTree) -> list[Node]:
    """Recompute everything the tree maintains incrementally and compare; returns the
    non-root nodes. O(nodes): for tests and debugging only."""
    with tree._mutex:
        nodes: list[Node] = []
        counted = {f"{tier}.{name}": 0 for tier in _TIERS for name in _COUNTED}
        stack = [tree.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.parent is node, f"{child!r} has a wrong parent"
                assert child.tokens and child.tokens[0] == first, f"{child!r} is misfiled"
                assert child.pins >= 0
                assert child.on_disk or not node.on_disk, f"{child!r} in memory below disk"
                stack.append(child)
            in_memory = sum(not c.on_disk for c in node.children.values())
            assert node.memory_children == in_memory, f"{node!r} miscounts memory children"
            if node is tree.root:
                assert node.pins == 0 and node.handle is None and not node.on_disk
                continue
            nodes.append(node)
            pins_below = sum(c.pins for c in node.children.values())
            assert node.pins >= pins_below, f"{node!r} pinned less than its children"
            if node.on_disk:
                assert node.handle is None, f"{node!r} on disk holds memory"
            if node.stored is not None:
                assert node.key == node.stored.key, f"{node!r} filed under another key"
            _check_data_is_its_path(node)
            if node.state is NodeState.PENDING:
                assert node.handle is None and node.stored is None, f"{node!r}"
                assert not node.on_disk, f"{node!r}"
                assert node.pins > pins_below, f"{node!r} lost its creator's pin"
                counted["memory.pending"] += 1
                continue
            assert node.state is NodeState.READY, f"{node!r} is in the tree"
            counted["memory.nodes"] += 1
            if node.stored is not None:
                counted["disk.nodes"] += 1
            kind = "pinned" if node.pins else "evictable"
            for tier, size in _TIERS.items():
                nbytes = size(node)
                if nbytes is None:
                    continue
                for unit, amount in (("bytes", nbytes), ("tokens", len(node.tokens))):
                    counted[f"{tier}.total_{unit}"] += amount
                    counted[f"{tier}.{kind}_{unit}"] += amount
        for lru, evictable in ((tree.lru, _evictable_leaf), (tree.disk_lru, _disk_leaf)):
            listed = list(lru)
            assert len(listed) == len(lru) == len({id(n) for n in listed})
            assert {id(n) for n in listed} == {id(n) for n in nodes if evictable(n)}, (
                "an LRU list is not its tier's evictable leaves")
        for data in ("handle", "stored"):
            owned = [id(getattr(n, data)) for n in nodes if getattr(n, data) is not None]
            assert len(owned) == len(set(owned)), f"a {data} is owned twice"
        s = tree._stats_locked()
    actual = {f"memory.{name}": getattr(s, name) for name in _COUNTED}
    actual |= {f"disk.{name}": getattr(s, "disk_" + name.removeprefix("total_"))
               for name in _COUNTED if name != "pending"}
    counted = {name: value for name, value in counted.items() if name in actual}
    assert actual == counted, f"stats {actual} != recomputed {counted}"
    for tier in ("", "disk_"):
        total = {unit: getattr(s, f"{tier}{'total_' if not tier else ''}{unit}")
                 for unit in ("bytes", "tokens")}
        for unit in ("bytes", "tokens"):
            pinned, evictable = getattr(s, f"{tier}pinned_{unit}"), getattr(
                s, f"{tier}evictable_{unit}")
            assert evictable + pinned == total[unit], f"{tier}{unit} do not add up"
    if tree.store is not None:
        assert s.disk_bytes <= tree.store.capacity_bytes, "over the disk budget"
    return nodes


def _check_data_is_its_path(node: Node) -> None:
    """The cache trust invariant: whatever a node holds, in memory or on disk, is the
    state of exactly its own tokens at exactly its place (a span covers its edge, a
    snapshot its whole path), so a request that reuses it gets the state of its tokens.
    Holds only for fake data, which records what it stands for."""
    path = node.path_tokens_locked()
    for data in (node.handle, node.stored):
        if not isinstance(data, (FakeHandle, FakeStored)):
            continue
        assert data.path == path, f"{node!r} at {path} holds {data!r}"
        if data.splittable:
            assert data.tokens == node.tokens, f"{node!r} holds a span of {data!r}"


def _evictable_leaf(node: Node) -> bool:
    return (node.state is NodeState.READY and node.pins == 0 and not node.on_disk
            and not any(not c.on_disk for c in node.children.values()))


def _disk_leaf(node: Node) -> bool:
    return (node.state is NodeState.READY and node.pins == 0 and node.on_disk
            and not node.children)


def pin_if_attached(tree: RadixTree, node: Node) -> bool:
    """`tree.pin(node)`, unless `node` left the tree since it was seen (then False): for a
    disk node a match reported, which nothing pins until its loader does."""
    with tree._mutex:
        if not tree._attached(node):
            return False
        tree._pin_path(node)
        return True


def evict_disk(tree: RadixTree, nbytes: float) -> int:
    """Delete least recently used disk leaves until `nbytes` are freed; returns that (the
    disk tier only evicts to make room for a save, which a test cannot aim as well)."""
    with tree._locked():
        return tree._evict_disk(nbytes)


def acquire(
    tree: RadixTree, tokens: Sequence[int], compute: Callable[[Node, Sequence[int]], Handle],
    load: Callable[[Stored], Handle | None] | None = None,
) -> Node:
    """A pinned node covering all of `tokens`, computing what is missing once.

    `compute(parent, rest)` builds the handle for `rest` on top of `parent`'s path; it
    runs outside the tree's lock. Threads that need the same missing prefix wait for the
    one computing it; if that computation fails they get its error. With a disk tier,
    `load(stored)` reads a disk node's data back (None if the copy went meanwhile, say
    another thread promoted and cut its node). The caller unpins the returned node. This
    is the engine's write path, written for blocking threads.
    """
    tokens = tuple(tokens)
    if not tokens:
        raise ValueError("acquire needs at least one token")
    while True:
        m = tree.match(tokens, pin=True)
        if m.disk:
            tree.unpin(m.node)
            assert load is not None, "a tree with a disk tier needs `load`"
            _load_path(tree, m.disk, load)
            continue
        if m.length == len(tokens):
            return m.node
        try:
            node = _acquire_step(tree, m, tokens, compute)
        finally:
            tree.unpin(m.node)
        if node is not None:
            return node


def _load_path(tree: RadixTree, nodes: list[Node],
               load: Callable[[Stored], Handle | None]) -> None:
    """Load and promote a match's disk nodes, pinned meanwhile (unless made room for on
    disk since the match: then the caller just matches again)."""
    if not pin_if_attached(tree, nodes[-1]):
        return
    try:
        for node in nodes:
            source = node.stored
            handle = load(source) if source is not None else None
            if handle is None:
                return
            tree.promote(node, handle, source)
    finally:
        tree.unpin(nodes[-1])


def _acquire_step(
    tree: RadixTree,
    m: MatchResult,
    tokens: tuple[int, ...],
    compute: Callable[[Node, Sequence[int]], Handle],
) -> Node | None:
    """One round of `acquire` with `m.node` pinned: a pinned node, or None to retry."""
    if m.in_flight is not None:
        m.in_flight.wait()
        return None
    rest = tokens[m.length :]
    reserved = tree.reserve(m.node, rest)
    if reserved.status is ReserveStatus.WAIT:
        reserved.node.wait()
        return None
    if reserved.status is ReserveStatus.RETRY:
        return None
    try:
        handle = compute(m.node, rest)
    except BaseException as error:
        tree.poison(reserved.node, error)
        raise
    tree.finalize(reserved.node, handle)
    return reserved.node
