"""Reservations: the optimistic write path of the tree.

A request that finds its remainder missing reserves a PENDING node, computes outside the
lock and publishes with `finalize` (or `poison` on failure). Requests that reach a PENDING
node wait on it (blocking with `Node.wait`, or without blocking via
`Node.add_done_callback`) and then match again, since the topology may have changed while
they waited. Waiters are woken only after the lock is released, because a callback may do
heavy work or re-enter the tree.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radix.node import Handle, Node, NodeState
from radix.prefix import common_prefix_length

log = logging.getLogger("radix_mlx.radix")


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


class Reservations:
    """The reservation part of `RadixTree`: reserve, then finalize or poison."""

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

    @staticmethod
    def _run_callbacks(node: Node, callbacks: list[Callable[[Node], None]]) -> None:
        # One failing waiter must not keep the others asleep.
        for fn in callbacks:
            try:
                fn(node)
            except Exception:
                log.exception("done callback of %r failed", node)
