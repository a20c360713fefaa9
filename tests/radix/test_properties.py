"""Random operation sequences against a naive model of what the tree should hold.

The model keeps the set of reusable prefixes (every prefix of a cached span; only the
ends of snapshots), the pending reservations and every pin the test holds. After every
step the tree must agree with it, and its own bookkeeping must add up.

With a disk tier, a match that reaches disk nodes loads and promotes them first (as the
engine does), and the model forgets a prefix only when no live data (a handle in memory,
or a copy on disk) covers it any more: nothing is lost that a tier still holds.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from radix import Node, NodeState, RadixTree, ReserveStatus
from tests.radix.support import FakeHandle, FakeStore, check_invariants, evict_disk

CAPACITY = 16
DISK_CAPACITY = 24
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple)


class Reservation:
    """A PENDING node this test created, and the waiters it owes an answer."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.path = node.path_tokens()
        self.start = len(self.path) - len(node.tokens)
        self.woken: list[tuple[NodeState, BaseException | None]] = []
        self.waiters = 0

    def add_waiter(self, tree: RadixTree) -> None:
        self.waiters += 1
        self.node.add_done_callback(
            lambda n: self.woken.append((n.state, n.error, tree._mutex.locked()))
        )


class TreeMachine(RuleBasedStateMachine):
    splittable = True

    reservations = Bundle("reservations")

    tiered = False

    @initialize()
    def setup(self) -> None:
        self.ledger: list[FakeHandle] = []
        self.store = FakeStore(DISK_CAPACITY) if self.tiered else None
        self.tree = RadixTree(CAPACITY, self._free, store=self.store)
        self.matchable: set[tuple[int, ...]] = set()
        self.pending: dict[int, Reservation] = {}
        self.pins: list[Node] = []

    def _free(self, handle: FakeHandle) -> None:
        assert not self.tree._mutex.locked(), "free() under the tree pin"
        handle.free()  # asserts it is the first free of a live handle

    # -- model ---------------------------------------------------------------------------

    def _handle(self, prefix: tuple[int, ...], tokens: tuple[int, ...]) -> FakeHandle:
        if self.splittable:
            return FakeHandle(tokens, prefix=prefix, ledger=self.ledger)
        return FakeHandle(prefix + tokens, splittable=False, ledger=self.ledger)

    def _live_reusable(self) -> set[tuple[int, ...]]:
        """Every prefix some live data (memory handle or disk copy) makes reusable."""
        live = [h for h in self.ledger if not h.freed and not h.consumed]
        live += self.store.live() if self.store else []
        return set().union(*map(self._reusable, live))

    def _reusable(self, handle: FakeHandle) -> set[tuple[int, ...]]:
        """The prefixes a handle makes reusable."""
        if not handle.splittable:
            return {handle.path}
        return {handle.path[:i] for i in range(len(handle.prefix) + 1, len(handle.path) + 1)}

    def _expected_length(self, tokens: tuple[int, ...]) -> int:
        """The longest reusable prefix; a reservation on the way stops the match."""
        r = self._pending_on(tokens)
        end = len(tokens) if r is None else r.start
        return max(k for k in range(end + 1) if k == 0 or tokens[:k] in self.matchable)

    def _pending_on(self, tokens: tuple[int, ...]) -> Reservation | None:
        """The first reservation on the path of `tokens` (a reserved junction may have
        others below it)."""
        on_path = [
            r
            for r in self.pending.values()
            if r.start < len(tokens) and tokens[: r.start + 1] == r.path[: r.start + 1]
        ]
        return min(on_path, key=lambda r: r.start, default=None)

    def _match(self, tokens: tuple[int, ...], pin: bool):
        expected = self._expected_length(tokens)
        assert self.tree.peek(tokens) == expected
        m = self.tree.match(tokens, pin=pin)
        if m.disk:  # the engine's way: pin, load and promote top first, match again
            assert m.disk_length == expected and m.length < expected
            if pin:
                self.tree.unpin(m.node)
            self.tree.pin(m.disk[-1])
            for node in m.disk:
                self.tree.promote(node, node.stored.load(self.ledger))
            self.tree.unpin(m.disk[-1])
            m = self.tree.match(tokens, pin=pin)
            assert not m.disk
        assert m.length == expected
        assert m.node.path_tokens() == tokens[:expected]
        assert m.node is self.tree.root or m.node.handle is not None
        r = self._pending_on(tokens)
        assert m.in_flight is (r.node if r else None)
        if r is not None:
            shared = 0
            while r.start + shared < min(len(r.path), len(tokens)) and (
                r.path[r.start + shared] == tokens[r.start + shared]
            ):
                shared += 1
            assert m.in_flight_shared == r.start - expected + shared
        if pin:
            self.pins.append(m.node)
        return m

    # -- rules ---------------------------------------------------------------------------

    @rule(tokens=tokens_st, pin=st.booleans())
    def match(self, tokens, pin):
        self._match(tokens, pin)

    @rule(target=reservations, tokens=tokens_st)
    def reserve(self, tokens):
        """The engine's admission: match pinned, then reserve the rest or wait."""
        m = self._match(tokens, pin=True)
        return self._reserve(m, tokens)

    @rule(target=reservations, tokens=tokens_st, published=tokens_st)
    def reserve_after_a_stale_match(self, tokens, published):
        """Someone publishes between our match and our reservation: we must retry."""
        m = self._match(tokens, pin=True)
        self._insert(self.tree.root, (), published, pin=False)
        if self._expected_length(tokens) > m.length:
            assert self.tree.reserve(m.node, tokens[m.length :]).status is (
                ReserveStatus.RETRY
            )
            return None
        return self._reserve(m, tokens)

    def _reserve(self, m, tokens) -> Reservation | None:
        if m.length == len(tokens):
            return None
        r = self.tree.reserve(m.node, tokens[m.length :])
        if m.in_flight is not None:
            assert (r.status, r.node) == (ReserveStatus.WAIT, m.in_flight)
            self.pending[id(r.node)].add_waiter(self.tree)
            return None
        assert r.node.path_tokens() == tokens
        assert r.status is ReserveStatus.CREATED and r.node.state is NodeState.PENDING
        reservation = Reservation(r.node)
        self.pending[id(r.node)] = reservation
        return reservation

    @rule(reservation=consumes(reservations), fail=st.booleans())
    def complete(self, reservation, fail):
        if reservation is None or id(reservation.node) not in self.pending:
            return
        node = reservation.node
        del self.pending[id(node)]
        if fail:
            error = RuntimeError("injected")
            self.tree.poison(node, error)
            assert node.parent is None and node.pins == 0
            assert reservation.woken == [(NodeState.POISONED, error, False)] * reservation.waiters
            return
        prefix = reservation.path[: reservation.start]
        handle = self._handle(prefix, reservation.path[reservation.start :])
        self.tree.finalize(node, handle)
        self.matchable |= self._reusable(handle)
        self.pins.append(node)  # the creator's pin, now on a READY node
        assert reservation.woken == [(NodeState.READY, None, False)] * reservation.waiters

    @rule(tokens=tokens_st, pin=st.booleans(), from_root=st.booleans())
    def insert(self, tokens, pin, from_root):
        """Publish a computed sequence (a generation, or a prompt computed unreserved),
        below its match or from the root over what is already cached."""
        m = self._match(tokens, pin=True)
        if from_root:
            self._insert(self.tree.root, (), tokens, pin)
        elif m.length < len(tokens):
            self._insert(m.node, tokens[: m.length], tokens[m.length :], pin)
        self.tree.unpin(m.node)
        self.pins.remove(m.node)

    def _disk_cut(self, path: tuple[int, ...]) -> int | None:
        """Where `path` ends or branches inside a span on disk: an insert stops above it."""
        node, depth = self.tree.root, 0
        while depth < len(path) and (child := node.children.get(path[depth])):
            edge = child.tokens
            if path[depth : depth + len(edge)] != edge:
                return depth if child.on_disk and self.splittable else None
            node, depth = child, depth + len(edge)
        return None

    def _insert(self, parent: Node, prefix: tuple, tokens: tuple, pin: bool) -> None:
        path = prefix + tokens
        blocked = self._pending_on(path)
        cut = self._disk_cut(path)
        handle = self._handle(prefix, tokens)
        node = self.tree.insert(parent, tokens, handle, pin=pin)
        if cut is not None and (blocked is None or cut < blocked.start):
            reached = node.path_tokens()
            assert len(prefix) <= len(reached) <= cut, "stops above the span on disk"
            self.matchable |= {p for p in self._reusable(handle) if len(p) <= len(reached)}
        elif blocked is None:
            assert node.path_tokens() == path
            self.matchable |= self._reusable(handle)
        else:
            reached = node.path_tokens()
            assert len(prefix) <= len(reached) <= blocked.start, "stops above the pending node"
            assert reached == path[: len(reached)]
            assert node is parent or node.handle is not None
            assert handle.freed or handle.consumed
        if pin:
            self.pins.append(node)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def repin(self, data):
        node = data.draw(st.sampled_from(self.pins))
        self.tree.pin(node)
        self.pins.append(node)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        node = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.tree.unpin(node)

    @rule(nbytes=st.integers(0, 20))
    def evict(self, nbytes):
        self._evicting(lambda: self.tree.evict(nbytes), nbytes)

    @rule()
    def enforce_capacity(self):
        excess = self.tree.stats().total_bytes - CAPACITY
        self._evicting(self.tree.enforce_capacity, excess)
        s = self.tree.stats()
        assert s.total_bytes <= CAPACITY or s.evictable_bytes == 0 or not self.tree.lru

    @precondition(lambda self: self.tiered)
    @rule(nbytes=st.integers(0, 20))
    def evict_disk(self, nbytes):
        before = self.tree.stats().disk_bytes
        freed = evict_disk(self.tree, nbytes)
        assert before - self.tree.stats().disk_bytes == freed
        assert freed >= nbytes or not self.tree.disk_lru

    @precondition(lambda self: self.tiered)
    @rule(full=st.booleans())
    def disk_queue_full(self, full):
        self.store.full = full

    @precondition(lambda self: self.tiered)
    @rule(traffic=st.lists(tokens_st, max_size=3))
    def restart(self, traffic):
        """The process stops and a new one starts on the same disk folder, serving
        `traffic` while it rebuilds its tree from the copies there (as a server does)."""
        copies = [(stored.parent_key, stored.span, stored.reread())
                  for stored in self.store.live()]
        for handle in self.ledger:  # memory dies with the process; copies stay
            if not handle.freed and not handle.consumed:
                handle.freed = 1
        self.pending.clear()
        self.pins.clear()
        self.tree = RadixTree(CAPACITY, self._free, store=self.store)
        self.matchable = set()
        for tokens in traffic:
            self._insert(self.tree.root, (), tokens, pin=False)
        _, rejected = self.tree.restore_all(copies)
        held = {id(n.stored) for n in check_invariants(self.tree) if n.stored is not None}
        for stored in rejected:
            assert id(stored) not in held
        for stored in self.store.live():  # refused, or the same file as a new copy's
            if id(stored) not in held:
                self.store.discard(stored)
        for node in check_invariants(self.tree):
            data = node.stored if node.on_disk else node.handle
            if data is not None:
                self.matchable |= self._reusable(data)

    @rule()
    def clear(self):
        self._evicting(self.tree.clear, float("inf"))
        assert not self.tree.lru and self.tree.stats().evictable_bytes == 0

    def _evicting(self, evict, wanted: float) -> None:
        freed_before = {id(h) for h in self.ledger if h.freed}
        freed = evict()
        now_freed = [h for h in self.ledger if h.freed and id(h) not in freed_before]
        assert freed == sum(h.nbytes for h in now_freed)
        assert freed >= wanted or not self.tree.lru
        for handle in now_freed:
            self.matchable -= self._reusable(handle)
        if self.tiered:  # demoted: still reusable from disk, after a load
            self.matchable |= self._live_reusable() & set().union(
                *map(self._reusable, now_freed))
        for node in self.pins:
            assert self._attached(node), f"pinned {node!r} was evicted"

    def _attached(self, node: Node) -> bool:
        while node.parent is not None:
            node = node.parent
        return node is self.tree.root

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def tree_agrees_with_the_model(self):
        if not hasattr(self, "tree"):
            return
        if self.tiered:  # making room on disk for a copy may delete other copies
            self.matchable &= self._live_reusable()
        nodes = check_invariants(self.tree)
        # pins counts every pin at or below a node: ours plus each creator's.
        expected: dict[int, int] = {}
        for pinned in self.pins + [r.node for r in self.pending.values()]:
            node = pinned
            while node is not self.tree.root:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        assert {id(n): n.pins for n in nodes if n.pins} == expected
        # Every handle ever made is in the tree, freed once, or consumed by a split.
        in_tree = {id(n.handle) for n in nodes if n.handle is not None}
        live = {id(h) for h in self.ledger if not h.freed and not h.consumed}
        assert in_tree == live
        if self.store is not None:
            in_tree = {id(n.stored) for n in nodes if n.stored is not None}
            assert in_tree == {id(c) for c in self.store.live()}, "a disk copy leaked"
        reusable: set[tuple[int, ...]] = set()
        for n in nodes:
            data = n.stored if n.on_disk else n.handle
            if data is not None:
                assert data.path == n.path_tokens()
                reusable |= self._reusable(data)
        assert reusable == self.matchable
        assert {id(n) for n in nodes if n.state is NodeState.PENDING} == set(self.pending)

    def teardown(self):
        if not hasattr(self, "tree"):
            return
        for reservation in list(self.pending.values()):
            self.tree.poison(reservation.node, RuntimeError("teardown"))
        for node in self.pins:
            self.tree.unpin(node)
        self.pending.clear()
        self.pins.clear()
        self.tree.clear()
        check_invariants(self.tree)
        s = self.tree.stats()
        assert (s.total_bytes, s.nodes, s.pending, s.disk_bytes) == (0, 0, 0, 0)
        assert all(h.freed or h.consumed for h in self.ledger)
        assert not self.store or not self.store.live()


class SnapshotTreeMachine(TreeMachine):
    splittable = False


class TieredTreeMachine(TreeMachine):
    tiered = True


class TieredSnapshotTreeMachine(TieredTreeMachine):
    splittable = False


SETTINGS = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSpans = TreeMachine.TestCase
TestSpans.settings = SETTINGS
TestSnapshots = SnapshotTreeMachine.TestCase
TestSnapshots.settings = SETTINGS
TestTieredSpans = TieredTreeMachine.TestCase
TestTieredSpans.settings = SETTINGS
TestTieredSnapshots = TieredSnapshotTreeMachine.TestCase
TestTieredSnapshots.settings = SETTINGS
