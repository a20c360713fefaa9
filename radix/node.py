"""The tree's nodes and the LRU lists that hold its evictable leaves.

A node owns opaque cache data: `Handle` in memory, `Stored` on disk. The tree never looks
inside either; it asks for a size, whether and where a handle splits, and a disk copy's key.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol


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
    splittable: bool
    key: str


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
        "path_state",
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
        self.path_state: Any = None  # the store's state of its path (radix/tiers.py)
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
        with self._mutex:  # a concurrent split rewrites tokens and parent together
            return self.path_tokens_locked()

    def path_tokens_locked(self) -> tuple[int, ...]:
        """`path_tokens`, for a caller that holds the tree's lock already."""
        parts = []
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
