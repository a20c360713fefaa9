"""Test doubles, an invariant checker, and `acquire` (the optimistic write loop for
blocking threads) for tests that use the radix tree without MLX."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from radix.tree import Handle, MatchResult, Node, NodeState, RadixTree, ReserveStatus


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


def check_invariants(tree: RadixTree) -> list[Node]:
    """Recompute everything the tree maintains incrementally and compare; returns the
    non-root nodes. O(nodes): for tests and debugging only."""
    with tree._mutex:
        nodes: list[Node] = []
        counted = dict.fromkeys(_COUNTED, 0)
        stack = [tree.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.parent is node, f"{child!r} has a wrong parent"
                assert child.tokens and child.tokens[0] == first, f"{child!r} is misfiled"
                assert child.pins >= 0
                stack.append(child)
            if node is tree.root:
                assert node.pins == 0 and node.handle is None
                continue
            nodes.append(node)
            pins_below = sum(c.pins for c in node.children.values())
            assert node.pins >= pins_below, f"{node!r} pinned less than its children"
            if node.state is NodeState.PENDING:
                assert node.handle is None, f"{node!r}"
                assert node.pins > pins_below, f"{node!r} lost its creator's pin"
                counted["pending"] += 1
                continue
            assert node.state is NodeState.READY, f"{node!r} is in the tree"
            counted["nodes"] += 1
            kind = "pinned" if node.pins else "evictable"
            for unit, amount in (("bytes", node.nbytes), ("tokens", len(node.tokens))):
                counted[f"total_{unit}"] += amount
                counted[f"{kind}_{unit}"] += amount
        listed = list(tree.lru)
        evictable = [n for n in nodes if _evictable_leaf(n)]
        assert len(listed) == len(tree.lru) == len({id(n) for n in listed})
        assert {id(n) for n in listed} == {id(n) for n in evictable}, "LRU != evictable leaves"
        handles = [id(n.handle) for n in nodes if n.handle is not None]
        assert len(handles) == len(set(handles)), "a handle is owned twice"
        s = tree._stats_locked()
    actual = {name: getattr(s, name) for name in _COUNTED}
    assert actual == counted, f"stats {actual} != recomputed {counted}"
    assert s.evictable_bytes + s.pinned_bytes == s.total_bytes
    assert s.evictable_tokens + s.pinned_tokens == s.total_tokens
    return nodes


def _evictable_leaf(node: Node) -> bool:
    return node.state is NodeState.READY and node.pins == 0 and not node.children


def acquire(
    tree: RadixTree, tokens: Sequence[int], compute: Callable[[Node, Sequence[int]], Handle]
) -> Node:
    """A pinned node covering all of `tokens`, computing what is missing once.

    `compute(parent, rest)` builds the handle for `rest` on top of `parent`'s path; it
    runs outside the tree's lock. Threads that need the same missing prefix wait for the
    one computing it; if that computation fails they get its error. The caller unpins the
    returned node. This is the engine's write path, written for blocking threads.
    """
    tokens = tuple(tokens)
    if not tokens:
        raise ValueError("acquire needs at least one token")
    while True:
        m = tree.match(tokens, pin=True)
        if m.length == len(tokens):
            return m.node
        try:
            node = _acquire_step(tree, m, tokens, compute)
        finally:
            tree.unpin(m.node)
        if node is not None:
            return node


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
