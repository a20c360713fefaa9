"""Many threads racing on overlapping prefixes, with failures and eviction injected."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import Counter

import pytest

from radix import NodeState, RadixTree
from tests.radix.support import FakeHandle, FakeStore, acquire, check_invariants

THREADS = 8
SYSTEMS = [tuple(range(100 * s, 100 * s + 8)) for s in range(3)]
USERS = [tuple(range(1000 + 10 * u, 1000 + 10 * u + 4)) for u in range(4)]


ROUNDS = 150


def tail(rng: random.Random) -> tuple[int, ...]:
    """A short, often repeated continuation, so requests also branch below the users."""
    return tuple(rng.randrange(3) for _ in range(rng.randint(0, 3)))


class InjectedFailure(Exception):
    pass


class Harness:
    """A tree, a ledger of every handle made, and a compute function that records what
    it computed and can be told to fail."""

    def __init__(self, splittable: bool, capacity: int = 1 << 30, failure_rate: float = 0.0,
                 disk: int = 0):
        self.splittable = splittable
        self.failure_rate = failure_rate
        self.ledger: list[FakeHandle] = []
        self.computed: list[tuple[int, ...]] = []  # reusable prefixes each compute made
        self.store = FakeStore(disk) if disk else None
        self.tree = RadixTree(capacity, FakeHandle.free, store=self.store)

    def load(self, stored) -> FakeHandle:
        time.sleep(random.uniform(0, 0.001))  # widen the race window
        return stored.load(self.ledger)

    def acquire(self, tokens) -> object:
        return acquire(self.tree, tokens, self.compute, self.load)

    def compute(self, parent, rest) -> FakeHandle:
        prefix = parent.path_tokens()
        time.sleep(random.uniform(0, 0.002))  # widen the race window
        if random.random() < self.failure_rate:
            raise InjectedFailure(prefix + tuple(rest))
        if self.splittable:
            handle = FakeHandle(rest, prefix=prefix, ledger=self.ledger)
            self.computed += [handle.path[:i] for i in range(len(prefix) + 1, len(handle.path) + 1)]
        else:
            handle = FakeHandle(prefix + tuple(rest), splittable=False, ledger=self.ledger)
            self.computed.append(handle.path)
        return handle

    def acquire_with_callbacks(self, tokens) -> object:
        """The engine's way: never block inside the tree; on a pending node register a
        callback, and when it fires match again."""
        tree = self.tree
        while True:
            m = tree.match(tokens, pin=True)
            if m.length == len(tokens):
                return m.node
            if m.in_flight is None:
                tree.unpin(m.node)
                return acquire(tree, tokens, self.compute)
            tree.unpin(m.node)
            woken: queue.SimpleQueue = queue.SimpleQueue()
            m.in_flight.add_done_callback(woken.put)
            node = woken.get(timeout=10)  # raises queue.Empty if never woken
            assert node.state in (NodeState.READY, NodeState.POISONED)

    def check_quiescent(self) -> None:
        nodes = check_invariants(self.tree)
        s = self.tree.stats()
        assert (s.pending, s.pinned_bytes, s.pinned_tokens) == (0, 0, 0)
        assert all(n.pins == 0 for n in nodes), "a pin leaked"
        in_tree = {id(n.handle) for n in nodes if n.handle is not None}
        live = {id(h) for h in self.ledger if not h.freed and not h.consumed}
        assert in_tree == live, "a handle leaked or was freed while in the tree"
        if self.store is not None:
            copies = {id(n.stored) for n in nodes if n.stored is not None}
            assert copies == {id(c) for c in self.store.live()}, "a disk copy leaked"
        self.tree.clear()
        assert all(h.freed or h.consumed for h in self.ledger)
        assert self.store is None or not self.store.live()


def run_threads(target, n: int = THREADS, timeout: float = 30) -> None:
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("splittable", [True, False], ids=["spans", "snapshots"])
def test_a_thundering_herd_computes_once_and_everyone_else_hits(splittable):
    h = Harness(splittable)
    tokens = SYSTEMS[0] + USERS[0]
    start = threading.Barrier(THREADS)
    got = []

    def request(i: int) -> None:
        start.wait()
        node = acquire(h.tree, tokens, h.compute)
        got.append(node)
        h.tree.unpin(node)

    run_threads(request)
    assert len(set(map(id, got))) == 1 and got[0].path_tokens() == tokens
    assert len(h.computed) == (len(tokens) if splittable else 1)
    h.check_quiescent()


@pytest.mark.parametrize("splittable", [True, False], ids=["spans", "snapshots"])
def test_racing_requests_compute_every_prefix_exactly_once(splittable):
    h = Harness(splittable)
    requested: set[tuple[int, ...]] = set()

    def requests(i: int) -> None:
        rng = random.Random(i)
        for _ in range(ROUNDS):
            tokens = rng.choice(SYSTEMS) + rng.choice(USERS)[: rng.randint(1, 4)] + tail(rng)
            requested.add(tokens)
            if rng.random() < 0.5:
                node = acquire(h.tree, tokens, h.compute)
            else:
                node = h.acquire_with_callbacks(tokens)
            assert node.path_tokens() == tokens and node.pins > 0
            h.tree.unpin(node)

    run_threads(requests)
    duplicates = [p for p, n in Counter(h.computed).items() if n > 1]
    assert not duplicates, f"computed twice: {duplicates[:3]}"
    if splittable:
        wanted = {t[:i] for t in requested for i in range(1, len(t) + 1)}
        assert set(h.computed) == wanted
    else:
        assert requested <= set(h.computed)
    h.check_quiescent()


@pytest.mark.parametrize("disk", [0, 200], ids=["memory", "disk-tier"])
@pytest.mark.parametrize("splittable", [True, False], ids=["spans", "snapshots"])
def test_failures_and_eviction_under_contention_leave_nothing_pending_or_pinned(
        splittable, disk):
    h = Harness(splittable, capacity=60, failure_rate=0.2, disk=disk)
    outcomes = Counter()
    stop = threading.Event()

    def requests(i: int) -> None:
        rng = random.Random(i)
        for _ in range(ROUNDS):
            tokens = rng.choice(SYSTEMS)[: rng.randint(4, 8)] + rng.choice(USERS) + tail(rng)
            try:
                node = h.acquire(tokens)
            except InjectedFailure as error:
                # Ours, or that of a request we waited on because it shared our prefix.
                assert tokens[0] == error.args[0][0]
                outcomes["error"] += 1
                continue
            outcomes["ok"] += 1
            assert node.path_tokens() == tokens
            if rng.random() < 0.3:
                generated = (9000 + i, 9001 + i)
                handle = (
                    FakeHandle(generated, prefix=tokens, ledger=h.ledger)
                    if splittable
                    else FakeHandle(tokens + generated, splittable=False, ledger=h.ledger)
                )
                h.tree.insert(node, generated, handle)
            h.tree.unpin(node)
            h.tree.enforce_capacity()

    def evictor() -> None:
        rng = random.Random(99)
        while not stop.is_set():
            h.tree.evict(rng.randint(1, 30))
            time.sleep(0.001)

    evicting = threading.Thread(target=evictor)
    evicting.start()
    try:
        run_threads(requests)
    finally:
        stop.set()
        evicting.join()
    assert outcomes["error"] > 0 and outcomes["ok"] > 0
    s = h.tree.stats()
    assert s.evictions > 0
    if disk:
        assert s.disk_demotions > 0 and s.disk_hits > 0 and s.disk_evictions > 0
    h.check_quiescent()


def test_every_waiter_of_a_failed_computation_gets_the_error():
    tree = RadixTree(1 << 30, FakeHandle.free)
    node = tree.reserve(tree.root, [1, 2, 3]).node
    errors = []
    start = threading.Barrier(THREADS + 1)

    def waiter(i: int) -> None:
        start.wait()
        try:
            node.wait(timeout=10)
        except InjectedFailure as error:
            errors.append(error)

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    start.wait()
    time.sleep(0.01)
    failure = InjectedFailure("boom")
    tree.poison(node, failure)
    for t in threads:
        t.join(10)
    assert errors == [failure] * THREADS
    s = tree.stats()
    assert (s.pending, s.nodes) == (0, 0)
