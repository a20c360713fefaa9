"""One request's hold on the radix tree, and every way it ends.

A request holds two things: a pin on the deepest tree node of its cached path (`node`,
covering its first `depth` tokens), so nothing it reuses is evicted under it; and, while
it computes a part of its prompt nobody has cached, that part's *reservation* (a PENDING
node), so requests that need the same part wait for it instead of computing it again.

`start` takes both, `publish` shares the computed prompt, `release` shares what was
generated and lets go, `abandon` lets go of a request that failed or gave up. Handles
come from the caller's `HandleOf`, so this module never touches MLX.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from radix import MatchResult, Node, RadixTree, ReserveResult, ReserveStatus

# The KV (or state) handle of tokens [start, end) of the request's cache.
HandleOf = Callable[[int, int], Any]


class Cancelled(Exception):
    """Poisons the reservation of a request that went away; its waiters match again."""


class TreeHold:
    def __init__(self, tree: RadixTree) -> None:
        self.tree = tree
        self.node: Node | None = None  # pinned while held
        self.depth = 0  # tokens covered by `node`
        self.reservation: Node | None = None  # the part this request computes for others

    def start(self, match: MatchResult, tokens: Sequence[int]) -> ReserveResult | None:
        """Pin `match.node` and, unless someone is computing it already (`match.in_flight`),
        reserve the rest of `tokens`. None once held; otherwise the tree's answer and
        nothing held: WAIT (a reservation of another request is in the way: wait for its
        node) or RETRY (the match went stale: match again)."""
        self.tree.pin(match.node)
        reservation = None
        if match.length < len(tokens) and match.in_flight is None:
            outcome = self.tree.reserve(match.node, tokens[match.length:])
            if outcome.status is not ReserveStatus.CREATED:
                self.tree.unpin(match.node)
                return outcome
            reservation = outcome.node
        self.node, self.depth, self.reservation = match.node, match.length, reservation
        return None

    def publishes(self, end: int) -> bool:
        """Whether `publish` up to `end` would put anything in the tree: a reservation to
        fill, or tokens past the held prefix. (A classify list's prompts, whose shared
        instruction the tree holds already, have none: their KV need not be read.)"""
        return self.reservation is not None or end > self.depth

    def publish(self, tokens: Sequence[int], end: int, handle_of: HandleOf,
                snapshots: Sequence[tuple[int, Any]] = ()) -> Node | None:
        """The first `end` of `tokens` are computed: put them in the tree, for others to
        share while this request goes on, with `snapshots` ((position, whole-state
        handle), taken at earlier positions, e.g. message ends) each on a node of its own.
        Returns the reservation of another request that stopped the insert short of
        `end` (publish again once it is done), else None."""
        blocker = None
        held, start = self.node, self.depth
        if self.reservation is not None:
            # The reservation was made pinned for this request: that pin replaces the one
            # on the node it hangs from.
            self.tree.finalize(self.reservation, handle_of(start, end))
            self.node, self.depth, self.reservation = self.reservation, end, None
        elif self.publishes(end):
            self.node = self.tree.insert(held, tokens[start:end], handle_of(start, end),
                                         pin=True)
            self.depth = len(self.node.path_tokens())
            if self.depth < end:
                blocker = self.tree.match(tokens[:end]).in_flight
        else:
            return None
        # On the path just published: each splits an edge and holds the state at its end.
        for position, snapshot in snapshots:
            self.tree.insert(held, tokens[start:position], snapshot)
        self.tree.unpin(held)
        self.tree.enforce_capacity()
        return blocker

    def release(self, tokens: Sequence[int], handle_of: HandleOf | None) -> None:
        """The request ended: insert what its cache holds beyond `depth` (all `tokens`;
        nothing when `handle_of` is None, i.e. nothing was computed), unpin."""
        self._drop_reservation(Cancelled())
        if handle_of is not None and len(tokens) > self.depth:
            self.tree.insert(self.node, tokens[self.depth:], handle_of(self.depth, len(tokens)))
        self._unpin()

    def withdraw(self) -> None:
        """Give up the reservation unfilled, keeping the pin until `release`: what the
        request computed cannot be shared. Its waiters match again."""
        self._drop_reservation(Cancelled())

    def abandon(self, error: BaseException) -> None:
        """Let go without sharing anything: a failed or cancelled start, or a failed step.
        Waiters on the reservation get `error` and match again."""
        self._drop_reservation(error)
        self._unpin()

    def _drop_reservation(self, error: BaseException) -> None:
        if self.reservation is not None:
            self.tree.poison(self.reservation, error)
            self.reservation = None

    def _unpin(self) -> None:
        if self.node is not None:
            self.tree.unpin(self.node)
        self.node, self.depth = None, 0
        self.tree.enforce_capacity()
