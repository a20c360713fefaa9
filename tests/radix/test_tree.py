"""Specification of the radix tree, one operation at a time, with fake handles."""

from __future__ import annotations

import itertools
import threading

import pytest

from radix import Miss, MissReason, NodeState, RadixTree, ReserveStatus
from radix.prefix import PREFIX_CHUNK, common_prefix_length
from tests.radix.support import FakeHandle, FakeStore, acquire, check_invariants, evict_disk

BIG = 1 << 30


class Tree(RadixTree):
    """A RadixTree that records frees, refuses double frees and frees under its pin,
    and checks all invariants after every public call that changes it."""

    def __init__(self, capacity_bytes: int = BIG) -> None:
        self.freed: list[FakeHandle] = []
        super().__init__(capacity_bytes, self._record_free)

    def _record_free(self, handle: FakeHandle) -> None:
        assert not self._mutex.locked(), "free() called under the tree pin"
        handle.free()
        self.freed.append(handle)

    def put(self, tokens, splittable: bool = True, bytes_per_token: int = 1):
        """Insert `tokens` from the root as one handle (a span, or a snapshot of the path)."""
        handle = FakeHandle(tokens, bytes_per_token, splittable)
        node = self.insert(self.root, tokens, handle)
        check_invariants(self)
        return node


def span(tokens, prefix=()) -> FakeHandle:
    return FakeHandle(tokens, prefix=prefix)


def snap(path) -> FakeHandle:
    return FakeHandle(path, splittable=False)


def edges(tree: RadixTree) -> set[tuple[int, ...]]:
    """Every node's full path, the tree's shape in a comparable form."""
    return {n.path_tokens() for n in check_invariants(tree)}


# -- match ---------------------------------------------------------------------------


def test_match_on_empty_tree_is_a_miss_at_the_root():
    tree = Tree()
    m = tree.match([1, 2, 3])
    assert (m.node, m.length, m.in_flight, m.in_flight_shared) == (tree.root, 0, None, 0)
    s = tree.stats()
    assert (s.hits, s.misses, s.hit_tokens) == (0, 1, 0)


def test_match_returns_the_longest_cached_prefix_and_counts_a_hit():
    tree = Tree()
    node = tree.put([1, 2, 3])
    m = tree.match([1, 2, 3, 4, 5])
    assert (m.node, m.length) == (node, 3)
    s = tree.stats()
    assert (s.hits, s.misses, s.hit_tokens) == (1, 0, 3)


def test_match_ending_inside_a_splittable_edge_splits_it_there():
    tree = Tree()
    tail = tree.put([1, 2, 3, 4], bytes_per_token=10)
    original = tail.handle
    m = tree.match([1, 2, 9])
    assert m.length == 2 and m.node.tokens == (1, 2)
    assert m.node.children == {3: tail} and tail.parent is m.node and tail.tokens == (3, 4)
    assert (m.node.handle.tokens, tail.handle.tokens) == ((1, 2), (3, 4))
    assert original.consumed and not tree.freed
    s = tree.stats()
    assert (s.nodes, s.total_bytes, s.total_tokens) == (2, 40, 4)
    check_invariants(tree)


def test_match_ending_where_the_query_ends_splits_too():
    tree = Tree()
    tree.put([1, 2, 3, 4])
    m = tree.match([1, 2, 3])
    assert m.length == 3 and m.node.tokens == (1, 2, 3)
    assert edges(tree) == {(1, 2, 3), (1, 2, 3, 4)}


def test_match_inside_an_unsplittable_edge_stops_at_the_previous_boundary():
    tree = Tree()
    a = tree.put([1, 2], splittable=False)
    tree.insert(a, [3, 4], snap([1, 2, 3, 4]))
    m = tree.match([1, 2, 3, 9])
    assert (m.node, m.length) == (a, 2)
    assert edges(tree) == {(1, 2), (1, 2, 3, 4)}, "a match never splits a snapshot"


def test_match_walks_through_junctions_but_never_returns_one():
    tree = Tree()
    tree.put([1, 2, 3, 4], splittable=False)
    tree.put([1, 2, 5, 6], splittable=False)  # splits the first into junction [1, 2]
    junction = tree.root.children[1]
    assert junction.tokens == (1, 2) and junction.handle is None
    assert tree.match([1, 2, 7]).node is tree.root
    m = tree.match([1, 2, 5, 6, 7])
    assert m.length == 4 and m.node.handle.path == (1, 2, 5, 6)


def test_match_reports_the_pending_node_the_query_continues_into():
    tree = Tree()
    a = tree.put([1, 2])
    tree.pin(a)
    r = tree.reserve(a, [3, 4, 5])
    m = tree.match([1, 2, 3, 4, 9])
    assert (m.node, m.length, m.in_flight, m.in_flight_shared) == (a, 2, r.node, 2)


def test_continuation_reads_what_followed_the_whole_context_along_the_latest_branch():
    tree = Tree()
    tree.put([1, 2, 3, 4, 5, 6])
    tree.put([1, 2, 3, 7, 8])
    assert tree.continuation([1, 2], 3) == [3, 7, 8]  # [1, 2, 3, 7, 8] was used last
    tree.match([1, 2, 3, 4])
    assert tree.continuation([1, 2], 9) == [3, 4, 5, 6]
    assert tree.continuation([1, 2, 3, 4, 5, 6], 4) == []  # nothing followed it
    assert tree.continuation([1, 2, 9], 4) == []  # not a path in the tree
    assert tree.continuation([1, 2, 3, 4, 5, 6, 7], 4) == []
    nodes, lru = tree.stats().nodes, list(tree.lru)
    tree.continuation([1], 8)
    assert (tree.stats().nodes, list(tree.lru)) == (nodes, lru)  # no split, no touch


def test_continuation_reads_tokens_a_pending_node_reserved():
    tree = Tree()
    a = tree.put([1, 2])
    tree.pin(a)
    tree.reserve(a, [3, 4, 5])
    assert tree.continuation([1, 2, 3], 4) == [4, 5]


def test_match_moves_the_matched_leaf_to_the_most_recently_used_end():
    tree = Tree()
    a, b = tree.put([1]), tree.put([2])
    assert list(tree.lru) == [a, b]
    tree.match([1])
    assert list(tree.lru) == [b, a]
    assert a.last_access > b.last_access


def test_match_with_pin_pins_the_result():
    tree = Tree()
    a = tree.put([1, 2])
    m = tree.match([1, 2], pin=True)
    assert m.node is a and a.pins == 1 and a not in tree.lru
    tree.unpin(a)
    assert a.pins == 0 and a in tree.lru


# -- pin / unpin ---------------------------------------------------------------------


def test_pin_pins_the_whole_path_and_moves_its_bytes_to_pinned():
    tree = Tree()
    a = tree.put([1, 2], bytes_per_token=3)
    b = tree.insert(a, [3], span([3], prefix=[1, 2]))
    tree.pin(b)
    assert (a.pins, b.pins, tree.root.pins) == (1, 1, 0)
    s = tree.stats()
    assert (s.pinned_bytes, s.evictable_bytes, s.pinned_tokens, s.evictable_tokens) == (7, 0, 3, 0)
    assert len(tree.lru) == 0
    check_invariants(tree)


def test_unpin_is_the_reverse_and_returns_the_leaf_to_the_lru_as_most_recent():
    tree = Tree()
    a, b = tree.put([1]), tree.put([2])
    tree.pin(a)
    tree.pin(a)
    tree.unpin(a)
    assert a.pins == 1 and list(tree.lru) == [b]
    tree.unpin(a)
    assert list(tree.lru) == [b, a]
    s = tree.stats()
    assert (s.pinned_bytes, s.evictable_bytes) == (0, 2)


def test_a_junction_cannot_be_pinned_on_its_own():
    tree = Tree()
    tree.put([1, 2, 3], splittable=False)
    tree.put([1, 2, 4], splittable=False)
    with pytest.raises(AssertionError):
        tree.pin(tree.root.children[1])


def test_unpin_of_an_unpinned_node_is_a_bug():
    tree = Tree()
    a = tree.put([1])
    with pytest.raises(AssertionError):
        tree.unpin(a)


def test_a_split_node_keeps_its_pins_on_both_halves():
    tree = Tree()
    tail = tree.put([1, 2, 3])
    tree.pin(tail)
    head = tree.match([1]).node
    assert head.pins == tail.pins == 1
    tree.unpin(tail)
    assert head.pins == tail.pins == 0
    check_invariants(tree)


def test_pinned_nodes_survive_eviction():
    tree = Tree()
    a = tree.put([1])
    tree.put([2])
    tree.pin(a)
    assert tree.clear() == 1
    assert edges(tree) == {(1,)} and [h.tokens for h in tree.freed] == [(2,)]
    tree.unpin(a)
    assert tree.clear() == 1 and edges(tree) == set()


# -- reserve / finalize / poison ------------------------------------------------


def test_reserve_reserves_a_pinned_pending_node_that_holds_no_bytes():
    tree = Tree()
    a = tree.put([1, 2])
    tree.pin(a)
    r = tree.reserve(a, [3, 4])
    assert r.status is ReserveStatus.CREATED
    node = r.node
    assert node.state is NodeState.PENDING and node.handle is None
    assert (node.parent, node.tokens, node.pins, a.pins) == (a, (3, 4), 1, 2)
    s = tree.stats()
    assert (s.pending, s.nodes, s.total_tokens, s.pinned_tokens) == (1, 1, 2, 2)
    check_invariants(tree)


def test_reserve_on_a_prefix_being_computed_says_wait_on_that_node():
    tree = Tree()
    first = tree.reserve(tree.root, [1, 2, 3]).node
    r = tree.reserve(tree.root, [1, 2, 7])
    assert (r.status, r.node) == (ReserveStatus.WAIT, first)
    assert tree.stats().pending == 1


def test_reserve_after_someone_published_the_prefix_says_retry():
    tree = Tree()
    tree.put([1, 2, 3])
    r = tree.reserve(tree.root, [1, 2, 9])  # as if matched before the put
    assert (r.status, r.node) == (ReserveStatus.RETRY, tree.root)
    assert tree.stats().pending == 0


def test_reserve_below_a_node_evicted_since_the_match_says_retry():
    tree = Tree()
    a = tree.put([1, 2])
    tree.clear()
    r = tree.reserve(a, [3])
    assert (r.status, r.node) == (ReserveStatus.RETRY, a)


def test_reserve_below_a_snapshot_splits_it_and_hangs_under_the_junction():
    tree = Tree()
    tree.put([1, 2, 3], splittable=False)
    r = tree.reserve(tree.root, [1, 2, 9])
    assert r.status is ReserveStatus.CREATED
    junction = r.node.parent
    assert (junction.tokens, junction.handle, r.node.tokens) == ((1, 2), None, (9,))
    assert junction.pins == 1
    check_invariants(tree)


def test_reserve_ending_on_a_junction_reserves_the_junction_itself():
    tree = Tree()
    tree.put([1, 2, 3], splittable=False)
    tree.put([1, 2, 4], splittable=False)
    junction = tree.root.children[1]
    r = tree.reserve(tree.root, [1, 2])
    assert (r.status, r.node) == (ReserveStatus.CREATED, junction)
    assert junction.state is NodeState.PENDING and len(junction.children) == 2
    assert tree.match([1, 2, 3]).in_flight is junction, "matches stop at a reservation"
    tree.finalize(junction, snap([1, 2]))
    assert tree.match([1, 2, 5]).node is junction
    assert tree.match([1, 2, 3]).length == 3
    check_invariants(tree)


def test_poison_of_a_reserved_junction_leaves_a_fresh_junction_for_its_children():
    tree = Tree()
    deeper = tree.put([1, 2, 3], splittable=False)
    tree.put([1, 2, 4], splittable=False)
    tree.pin(deeper)
    junction = tree.reserve(tree.root, [1, 2]).node
    assert junction.pins == 2
    tree.poison(junction, RuntimeError("failed"))
    assert junction.state is NodeState.POISONED and junction.parent is None
    fresh = deeper.parent
    assert fresh is not junction and fresh.tokens == (1, 2) and fresh.handle is None
    assert fresh.state is NodeState.READY and fresh.pins == 1 and len(fresh.children) == 2
    assert tree.match([1, 2, 3]).node is deeper
    check_invariants(tree)


def test_finalize_publishes_the_handle_and_wakes_waiters_outside_the_lock():
    tree = Tree()
    node = tree.reserve(tree.root, [1, 2]).node
    seen = []
    node.add_done_callback(lambda n: seen.append((n.state, tree._mutex.locked())))
    tree.finalize(node, span([1, 2]))
    assert seen == [(NodeState.READY, False)]
    assert node.state is NodeState.READY and node.pins == 1, "the creator still holds its pin"
    s = tree.stats()
    assert (s.pending, s.nodes, s.pinned_bytes, s.evictable_bytes) == (0, 1, 2, 0)
    assert tree.match([1, 2]).node is node
    tree.unpin(node)
    assert list(tree.lru) == [node]


def test_a_callback_added_after_completion_runs_at_once():
    tree = Tree()
    node = tree.reserve(tree.root, [1]).node
    tree.finalize(node, span([1]))
    seen = []
    node.add_done_callback(seen.append)
    assert seen == [node]
    node.wait(timeout=0)


def test_callbacks_may_reenter_the_tree():
    tree = Tree()
    node = tree.reserve(tree.root, [1]).node
    results = []
    node.add_done_callback(lambda n: results.append(tree.match([1]).node))
    tree.finalize(node, span([1]))
    assert results == [node]


def test_a_failing_callback_does_not_starve_the_others():
    tree = Tree()
    node = tree.reserve(tree.root, [1]).node
    seen = []
    node.add_done_callback(lambda n: 1 / 0)
    node.add_done_callback(seen.append)
    tree.finalize(node, span([1]))
    assert seen == [node]


def test_wait_blocks_until_finalize():
    tree = Tree()
    node = tree.reserve(tree.root, [1]).node
    with pytest.raises(TimeoutError):
        node.wait(timeout=0.01)
    threading.Timer(0.01, tree.finalize, (node, span([1]))).start()
    node.wait(timeout=5)
    assert node.state is NodeState.READY


def test_poison_removes_the_node_releases_its_pins_and_wakes_waiters_with_the_error():
    tree = Tree()
    a = tree.put([1, 2])
    tree.pin(a)  # the creator's pin from its match
    node = tree.reserve(a, [3]).node
    errors = []
    node.add_done_callback(lambda n: errors.append(n.error))
    boom = RuntimeError("prefill failed")
    tree.poison(node, boom)
    assert errors == [boom]
    assert node.state is NodeState.POISONED and node.parent is None and node.pins == 0
    with pytest.raises(RuntimeError, match="prefill failed"):
        node.wait()
    assert a.children == {} and a.pins == 1
    tree.unpin(a)  # the creator unpins only what it pinned itself
    s = tree.stats()
    assert (s.pending, s.pinned_bytes, s.evictable_bytes) == (0, 0, 2)
    assert list(tree.lru) == [a]
    check_invariants(tree)


def test_finalize_or_poison_of_a_node_that_is_not_pending_is_a_bug():
    tree = Tree()
    node = tree.reserve(tree.root, [1]).node
    tree.poison(node, RuntimeError())
    with pytest.raises(ValueError):
        tree.finalize(node, span([1]))
    with pytest.raises(ValueError):
        tree.poison(node, RuntimeError())


# -- insert ----------------------------------------------------------------------------


def test_insert_adds_an_evictable_ready_leaf():
    tree = Tree()
    node = tree.put([1, 2, 3], bytes_per_token=2)
    assert node.state is NodeState.READY and node.pins == 0
    assert list(tree.lru) == [node]
    s = tree.stats()
    assert (s.nodes, s.total_bytes, s.evictable_bytes, s.total_tokens) == (1, 6, 6, 3)


def test_insert_keeps_what_is_cached_and_frees_the_overlapping_head_of_the_handle():
    tree = Tree()
    a = tree.put([1, 2])
    node = tree.insert(tree.root, [1, 2, 3, 4], span([1, 2, 3, 4]))
    assert node.parent is a and node.tokens == (3, 4) and node.handle.tokens == (3, 4)
    assert [h.tokens for h in tree.freed] == [(1, 2)]
    assert tree.stats().total_bytes == 4


def test_insert_of_a_cached_sequence_frees_the_whole_handle():
    tree = Tree()
    a = tree.put([1, 2])
    duplicate = span([1, 2])
    assert tree.insert(tree.root, [1, 2], duplicate) is a
    assert tree.freed == [duplicate]


def test_insert_ending_inside_an_edge_splits_it_and_returns_the_head():
    tree = Tree()
    tree.put([1, 2, 3])
    node = tree.insert(tree.root, [1, 2], span([1, 2]))
    assert node.tokens == (1, 2) and node.handle.tokens == (1, 2)
    assert edges(tree) == {(1, 2), (1, 2, 3)}


def test_insert_diverging_inside_an_edge_splits_it_and_branches():
    tree = Tree()
    tree.put([1, 2, 3])
    node = tree.insert(tree.root, [1, 2, 7, 8], span([1, 2, 7, 8]))
    assert node.tokens == (7, 8) and node.handle.prefix == (1, 2)
    assert edges(tree) == {(1, 2), (1, 2, 3), (1, 2, 7, 8)}


def test_insert_stops_at_a_pending_node_and_frees_the_rest():
    tree = Tree()
    tree.reserve(tree.root, [1, 2])
    handle = span([1, 2, 3])
    assert tree.insert(tree.root, [1, 2, 3], handle) is tree.root
    assert tree.freed == [handle]


def test_insert_of_a_snapshot_splits_topology_with_a_junction_that_holds_nothing():
    tree = Tree()
    first = tree.put([1, 2, 3], splittable=False, bytes_per_token=10)
    second = tree.put([1, 2, 4, 5], splittable=False, bytes_per_token=10)
    junction = first.parent
    assert junction is second.parent and junction.tokens == (1, 2) and junction.handle is None
    assert first.handle.path == (1, 2, 3) and not tree.freed
    s = tree.stats()
    assert (s.nodes, s.total_bytes, s.total_tokens) == (3, 70, 5)


def test_insert_with_pin_returns_the_node_pinned():
    tree = Tree()
    node = tree.insert(tree.root, [1], span([1]), pin=True)
    assert node.pins == 1 and tree.stats().pinned_bytes == 1


def test_bulk_insert_of_a_generation_below_its_prompt_node():
    tree = Tree()
    prompt = acquire(tree, [1, 2, 3], lambda parent, rest: span(rest))
    generated = tree.insert(prompt, [7, 8, 9], span([7, 8, 9], prefix=[1, 2, 3]))
    tree.unpin(prompt)
    assert generated.parent is prompt
    assert tree.match([1, 2, 3, 7, 8, 9, 10]).length == 6
    assert list(tree.lru) == [generated]


def test_empty_token_sequences_are_rejected():
    tree = Tree()
    with pytest.raises(ValueError):
        tree.reserve(tree.root, [])
    with pytest.raises(ValueError):
        tree.insert(tree.root, [], span([]))


# -- eviction --------------------------------------------------------------------------


def test_evict_frees_least_recently_used_leaves_first():
    tree = Tree()
    a, b, c = tree.put([1]), tree.put([2]), tree.put([3])
    tree.match([1])
    assert tree.evict(2) == 2
    assert [h.tokens for h in tree.freed] == [(2,), (3,)]
    assert edges(tree) == {(1,)} and a.parent is tree.root
    assert b.parent is None and c.handle is None, "evicted nodes are detached and empty"
    assert tree.stats().evictions == 2


def test_evict_cascades_to_a_parent_that_becomes_an_evictable_leaf():
    tree = Tree()
    parent = tree.put([1, 2])
    tree.insert(parent, [3], span([3], prefix=[1, 2]))
    other = tree.put([9])
    assert list(tree.lru) == [parent.children[3], other]
    assert tree.evict(1) == 1
    assert list(tree.lru) == [parent, other], "the exposed parent is evicted next"
    assert tree.evict(1) == 2
    assert edges(tree) == {(9,)}


def test_evict_stops_once_enough_bytes_are_freed_or_nothing_is_left():
    tree = Tree()
    tree.put([1, 2, 3])
    tree.put([4, 5, 6])
    assert tree.evict(1) == 3
    assert tree.evict(100) == 3
    assert tree.evict(100) == 0
    assert tree.evict(0) == 0


def test_enforce_capacity_evicts_down_to_the_budget():
    tree = Tree(capacity_bytes=5)
    for t in range(4):
        tree.put([t, t, t])
    assert tree.enforce_capacity() == 9
    assert tree.stats().total_bytes == 3
    assert tree.enforce_capacity() == 0


def test_clear_evicts_everything_unpinned_including_junctions():
    tree = Tree()
    tree.put([1, 2, 3], splittable=False)
    tree.put([1, 2, 4], splittable=False)
    assert tree.clear() == 6
    assert edges(tree) == set() and len(tree.freed) == 2
    s = tree.stats()
    assert (s.total_bytes, s.total_tokens, s.nodes, s.evictions) == (0, 0, 0, 3)


# -- acquire ---------------------------------------------------------------------------


def test_acquire_computes_the_missing_suffix_once_then_hits():
    tree = Tree()
    calls = []

    def compute(parent, rest):
        calls.append((parent.path_tokens(), tuple(rest)))
        return span(rest, prefix=parent.path_tokens())

    first = acquire(tree, [1, 2, 3], compute)
    tree.unpin(first)
    second = acquire(tree, [1, 2, 3, 4], compute)
    assert calls == [((), (1, 2, 3)), ((1, 2, 3), (4,))]
    assert second.parent is first and second.pins == 1 and first.pins == 1
    tree.unpin(second)
    assert acquire(tree, [1, 2], compute).tokens == (1, 2), "a hit inside an edge splits it"
    assert len(calls) == 2


def test_acquire_poisons_and_reraises_when_compute_fails():
    tree = Tree()
    tree.put([1])

    def compute(parent, rest):
        raise OSError("out of memory")

    with pytest.raises(OSError):
        acquire(tree, [1, 2], compute)
    s = tree.stats()
    assert (s.pending, s.pinned_bytes, s.nodes) == (0, 0, 1)
    check_invariants(tree)


def test_acquire_fills_a_junction_for_snapshot_handles():
    tree = Tree()
    tree.put([1, 2, 3], splittable=False)
    node = acquire(tree, [1, 2], lambda parent, rest: snap(parent.path_tokens() + tuple(rest)))
    assert node.tokens == (1, 2) and node.handle.path == (1, 2) and node.pins == 1


def test_peek_reports_the_match_length_without_changing_anything():
    tree = Tree()
    a, b = tree.put([1, 2, 3, 4]), tree.put([5])
    before = (edges(tree), list(tree.lru), tree.stats())
    assert tree.peek([1, 2, 9]) == 2 and tree.peek([1, 2, 3, 4, 5]) == 4
    assert tree.peek([7]) == 0
    assert (edges(tree), list(tree.lru), tree.stats()) == before
    assert list(tree.lru) == [a, b]


# -- the disk tier ---------------------------------------------------------------------


def tiered(capacity: int = BIG, disk: int = BIG) -> tuple[Tree, FakeStore]:
    tree = Tree(capacity)
    tree.store = store = FakeStore(disk)
    return tree, store


def test_a_published_handle_is_copied_to_disk_at_once():
    tree, store = tiered()
    node = tree.put([1, 2, 3])
    assert [s.path for s in store.saved] == [(1, 2, 3)] and node.stored is store.saved[0]
    s = tree.stats()
    assert (s.total_bytes, s.disk_bytes, s.disk_nodes) == (3, 3, 1)


def test_memory_eviction_keeps_a_copied_node_in_place_on_disk():
    tree, store = tiered()
    tree.put([1, 2, 3])
    assert tree.evict(3) == 3
    (node,) = check_invariants(tree)
    assert node.on_disk and node.handle is None and node.stored.path == (1, 2, 3)
    assert tree.freed and not store.saved[0].discarded
    s = tree.stats()
    assert (s.total_bytes, s.disk_bytes, s.evictions, s.disk_demotions) == (0, 3, 1, 1)


def test_a_match_reports_disk_nodes_and_promote_brings_them_back_as_a_disk_hit():
    tree, _ = tiered()
    tree.put([1, 2])
    tree.insert(tree.match([1, 2]).node, [3, 4], span([3, 4], prefix=(1, 2)))
    tree.evict(4)
    m = tree.match([1, 2, 3, 4, 5])
    assert (m.node, m.length, m.disk_length) == (tree.root, 0, 4)
    assert [n.path_tokens() for n in m.disk] == [(1, 2), (1, 2, 3, 4)]
    assert tree.peek([1, 2, 3, 4, 5]) == 4
    tree.pin(m.disk[-1])
    for node in m.disk:
        tree.promote(node, node.stored.load())
    tree.unpin(m.disk[-1])
    assert tree.match([1, 2, 3, 4, 5]).length == 4
    s = tree.stats()
    assert (s.disk_hits, s.disk_hit_tokens, s.total_bytes, s.disk_bytes) == (2, 4, 4, 4)
    check_invariants(tree)


def test_a_promotion_makes_room_in_memory_for_what_it_brings_back():
    """The request that loads a node may wait, or go, before it holds it: whatever it
    brings back comes into the budget at once, pushing out what nothing pins."""
    tree, _ = tiered(capacity=4)
    tree.put([1, 2, 3])
    tree.evict(3)
    tree.put([7, 8, 9])
    (loaded,) = tree.match([1, 2, 3]).disk
    tree.pin(loaded)
    tree.promote(loaded, loaded.stored.load())
    tree.unpin(loaded)
    s = tree.stats()
    assert s.total_bytes == 3 <= s.capacity_bytes
    assert tree.match([1, 2, 3]).length == 3 and tree.match([7, 8, 9]).disk_length == 3
    check_invariants(tree)


def test_a_match_ending_inside_a_span_on_disk_reports_it_whole():
    tree, _ = tiered()
    tree.put([1, 2, 3, 4])
    tree.evict(4)
    m = tree.match([1, 2, 9])
    assert [n.tokens for n in m.disk] == [(1, 2, 3, 4)] and m.disk_length == 2


def test_memory_evicts_leaves_above_disk_nodes_and_only_memory_counts_for_its_budget():
    tree, _ = tiered(capacity=4)
    tree.put([1, 2])
    tree.insert(tree.match([1, 2]).node, [3, 4], span([3, 4], prefix=(1, 2)))
    tree.put([7, 8, 9])
    tree.enforce_capacity()
    s = tree.stats()
    assert s.total_bytes <= 4 and s.disk_bytes == 7
    assert {n.path_tokens() for n in check_invariants(tree) if n.on_disk} == {(1, 2), (1, 2, 3, 4)}


def test_the_disk_budget_evicts_disk_leaves_least_recently_used_first():
    tree, store = tiered(disk=5)
    tree.put([1, 2])
    tree.evict(2)
    tree.put([3, 4])
    tree.evict(2)
    tree.put([5, 6, 7])  # needs room: the oldest disk node goes
    assert [s.path for s in store.saved if s.discarded] == [(1, 2)]
    assert edges(tree) == {(3, 4), (5, 6, 7)}
    assert tree.stats().disk_evictions == 1


def test_without_a_copy_an_evicted_span_is_dropped_with_its_subtree():
    tree, store = tiered()
    store.full = True  # the writer's queue is full: no copy
    tree.put([1, 2])
    store.full = False
    tree.insert(tree.match([1, 2]).node, [3], span([3], prefix=(1, 2)))
    tree.evict(1)  # [3] goes to disk
    tree.evict(2)  # [1, 2] has no copy: it and [3] below it are gone
    assert edges(tree) == set() and store.saved[0].discarded


def test_clear_drops_both_tiers():
    tree, store = tiered()
    tree.put([1, 2])
    tree.evict(2)
    tree.put([3])
    tree.clear()
    assert edges(tree) == set() and all(s.discarded for s in store.saved)
    s = tree.stats()
    assert (s.total_bytes, s.disk_bytes) == (0, 0)


def test_restore_rebuilds_disk_nodes_from_copies_alone():
    tree, store = tiered()
    tree.put([1, 2])
    tree.insert(tree.match([1, 2]).node, [3, 4], span([3, 4], prefix=(1, 2)))
    first, second = store.saved
    fresh, _ = tiered()
    top = fresh.restore(fresh.root, first.tokens, first)
    below = fresh.restore(top, second.tokens, second)
    assert below.path_tokens() == (1, 2, 3, 4) and below.on_disk
    assert fresh.restore(fresh.root, first.tokens, first) is top  # the same copy again
    assert fresh.match([1, 2, 3, 4]).disk == [top, below]
    check_invariants(fresh)


def test_restoring_pauses_after_each_copy_and_ends_with_restore_alls_result():
    """The engine's thread restores a tier of many files a slice at a time, serving
    between slices: the tree is whole after each pause."""
    tree, store = tiered()
    tree.put([1, 2])
    tree.insert(tree.match([1, 2]).node, [3, 4], span([3, 4], prefix=(1, 2)))
    tree.put([7])
    fresh, _ = tiered()
    steps = fresh.restoring([(s.parent_key, s.span, s) for s in store.saved])
    pauses = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            assert done.value == (3, [])
            break
        pauses += 1
        check_invariants(fresh)
    assert pauses == 3 and edges(fresh) == {(1, 2), (1, 2, 3, 4), (7,)}


def test_a_copy_through_a_node_being_computed_waits_for_it_with_those_below():
    """A request that came during the rebuild computes the path of a stored prompt: its
    copy, and every copy below it, wait for that node instead of being deleted."""
    tree, store = tiered()
    tree.put([1, 2])
    tree.insert(tree.match([1, 2]).node, [3, 4], span([3, 4], prefix=(1, 2)))
    copies = [(s.parent_key, s.span, s) for s in store.saved]
    fresh, _ = tiered()
    computing = fresh.reserve(fresh.root, [1, 2, 3]).node
    steps = fresh.restoring(copies, patience=60)
    assert set(itertools.takewhile(lambda waits: not waits, steps)) == {False}  # then True
    fresh.finalize(computing, span([1, 2, 3]))
    fresh.unpin(computing)
    restored = None
    while restored is None:
        try:
            next(steps)
        except StopIteration as done:
            restored = done.value
    assert restored[1] == []  # none deleted
    assert [node.path_tokens() for node in fresh.match([1, 2, 3, 4]).disk] == [(1, 2, 3, 4)]
    check_invariants(fresh)
    impatient, _ = tiered()
    impatient.reserve(impatient.root, [1, 2, 3])
    assert impatient.restore_all(copies)[1] == [s for _, _, s in copies]  # as before


def test_a_copy_following_one_written_since_the_listing_hangs_below_its_live_node():
    """The rebuild lists the files, then reads them while requests are served: a file
    rewritten meanwhile names a parent written after the listing, which the tree holds."""
    tree, store = tiered()
    tree.put([1, 2])
    tree.insert(tree.match([1, 2]).node, [3, 4], span([3, 4], prefix=(1, 2)))
    _, below = store.saved
    fresh, _ = tiered()
    fresh.put([1, 2])  # a request's, filed under the same key as the file not listed
    restored, rejected = fresh.restore_all([(below.parent_key, below.span, below)])
    assert (restored, rejected) == (1, [])
    assert [node.path_tokens() for node in fresh.match([1, 2, 3, 4]).disk] == [(1, 2, 3, 4)]


def test_restore_refuses_copies_over_the_disk_budget():
    tree, store = tiered()
    tree.put([1, 2, 3])
    fresh, _ = tiered(disk=2)
    assert fresh.restore(fresh.root, (1, 2, 3), store.saved[0]) is None


def test_memory_keys_name_the_copies_of_what_memory_holds_most_recently_used_first():
    tree, store = tiered()
    tree.put([1, 2])
    tree.insert(tree.match([1, 2]).node, [3], span([3], prefix=(1, 2)))
    tree.put([7, 8])
    tree.put([5])
    tree.evict(1)  # the least recently used leaf, [3] below [1, 2], goes to disk
    tree.match([7, 8])
    store.full = True
    tree.put([9])  # no copy: nothing to bring back from disk
    keys = {s.path: s.key for s in store.saved}
    assert tree.memory_keys() == [keys[(7, 8)], keys[(5,)], keys[(1, 2)]]


def test_holding_finds_the_disk_nodes_of_recorded_keys_in_their_order():
    tree, store = tiered()
    tree.put([1, 2])
    tree.insert(tree.match([1, 2]).node, [3], span([3], prefix=(1, 2)))
    tree.put([4])
    key = {s.path: s.key for s in store.saved}
    fresh, _ = tiered()  # a restart that found the copies of [1, 2] and [1, 2, 3] only
    fresh.restore_all((s.parent_key or store.root_key, s.span, s) for s in store.saved[:2])
    found = fresh.holding([key[(1, 2, 3)], "gone", key[(4,)], key[(1, 2)]])
    assert [n.path_tokens() for n in found] == [(1, 2, 3), (1, 2)]
    assert all(n.on_disk for n in found)


def test_a_split_leaves_the_copies_below_it_their_parent_for_a_restart():
    """A span with a copy below it is split by a prompt that parts from it midway: the
    tail is saved again under its old key (its path ends where the span's did), so the
    copy below still names its parent, and a restart restores every copy there is."""
    tree, store = tiered()
    tree.put([1, 2, 3, 4])
    tree.insert(tree.match([1, 2, 3, 4]).node, [5], span([5], prefix=(1, 2, 3, 4)))
    below = store.saved[-1]
    tree.put([1, 2, 9])  # cuts [1, 2, 3, 4] after [1, 2]
    tail = next(s for s in store.live() if s.span == (3, 4))
    assert tail.key == below.parent_key
    fresh, _ = tiered()
    live = store.live()
    restored, rejected = fresh.restore_all((s.parent_key, s.span, s) for s in live)
    assert rejected == [] and restored == len(live) == 4
    assert [n.path_tokens() for n in fresh.match([1, 2, 3, 4, 5]).disk] == [
        (1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5)]
    check_invariants(fresh)


def test_disk_chain_is_what_loading_a_node_takes_top_first_and_empty_once_loaded():
    tree, _ = tiered()
    tree.put([1, 2])
    tree.insert(tree.match([1, 2]).node, [3, 4], span([3, 4], prefix=(1, 2)))
    tree.evict(4)
    top, below = tree.match([1, 2, 3, 4]).disk
    assert tree.disk_chain(below) == [top, below] and tree.disk_chain(top) == [top]
    tree.promote(top, top.stored.load())
    assert tree.disk_chain(top) == [] and tree.disk_chain(below) == [below]
    tree.drop(below)
    assert tree.disk_chain(below) == []


def test_drop_removes_an_unreadable_disk_node_and_its_subtree():
    tree, store = tiered()
    tree.put([1, 2])
    tree.insert(tree.match([1, 2]).node, [3], span([3], prefix=(1, 2)))
    tree.evict(3)
    tree.drop(tree.match([1, 2, 3]).disk[0])
    assert edges(tree) == set() and all(s.discarded for s in store.saved)


def test_copies_the_store_failed_to_write_leave_the_tree_and_its_disk_bytes():
    """A full disk: copies queued but never written. A node in memory keeps its data, a
    node on disk (its only data gone) goes with its subtree, and the disk tier counts
    neither copy, which its budget would otherwise make room for by evicting copies
    that are there."""
    tree, store = tiered()
    tree.put([1, 2])
    tree.insert(tree.match([1, 2]).node, [3], span([3], prefix=(1, 2)))
    tree.evict(1)  # [3] to disk
    tree.put([7])
    written, *failed = store.saved
    tree.forget_copies(failed)
    assert edges(tree) == {(1, 2), (7,)}
    assert tree.match([1, 2]).length == 2 and tree.match([1, 2]).node.stored is written
    assert tree.match([7]).length == 1 and tree.match([7]).node.stored is None
    assert tree.stats().disk_bytes == written.nbytes
    check_invariants(tree)


def test_publishing_over_a_span_on_disk_takes_it_back_into_memory():
    tree, _ = tiered()
    tree.put([1, 2])
    tree.evict(2)
    tree.put([1, 2, 3])
    top, _ = sorted(check_invariants(tree), key=lambda n: len(n.path_tokens()))
    assert not top.on_disk and top.handle is not None and top.stored is not None
    assert tree.match([1, 2, 3]).length == 3


@pytest.mark.parametrize("kind", [tuple, list])
@pytest.mark.parametrize("differ_at", [0, 1, PREFIX_CHUNK - 1, PREFIX_CHUNK, 3 * PREFIX_CHUNK + 5,
                                       None])
@pytest.mark.parametrize("start", [0, 7])
def test_common_prefix_length_finds_the_first_difference_after_start(kind, differ_at, start):
    """Across chunk boundaries, from an offset into the second sequence, for both
    sequence types; a whole match is the shorter length."""
    a = list(range(1000, 1000 + 5 * PREFIX_CHUNK))
    b = [-1] * start + a + [5]
    if differ_at is not None:
        b[start + differ_at] = -2
    assert common_prefix_length(kind(a), kind(b), start) == (
        len(a) if differ_at is None else differ_at)
    assert common_prefix_length(kind(b[start:]), kind(a)) == (
        len(a) if differ_at is None else differ_at)


def test_a_span_copy_below_a_node_made_since_it_was_written_stands_for_its_rest():
    """The disk tier's wrong-KV bug: a server restarted and served traffic while it
    rebuilt its tree. Traffic had split off `1, 2` as a node of its own; the file of
    `1, 2, 3, 4, 5` (KV of positions 0-4) was then hung below it as `3, 4, 5`, three
    tokens holding five positions, and every later split and child inherited the shift.
    The node below `1, 2` stands for the file's positions 2-4 alone (`Store.tail`)."""
    old, store = tiered()
    old.put([1, 2, 3, 4, 5])
    (copy,) = store.saved
    fresh, _ = tiered()
    fresh.put([1, 2, 7])
    fresh.insert(fresh.match([1, 2]).node, [8], span([8], prefix=(1, 2)))
    node = fresh.restore(fresh.root, copy.span, copy)
    assert node.tokens == (3, 4, 5) and node.stored is copy and node.on_disk
    assert (copy.prefix, copy.tokens) == ((1, 2), (3, 4, 5))  # what loading it gives
    assert edges(fresh) == {(1, 2), (1, 2, 7), (1, 2, 8), (1, 2, 3, 4, 5)}


def test_a_span_copy_over_two_edges_of_its_tokens_is_the_last_ones():
    old, store = tiered()
    old.put([1, 2, 3, 4])
    (copy,) = store.saved
    fresh = Tree()
    fresh.put([1, 2, 3, 4])
    fresh.match([1, 2])  # splits the fresh node: `3, 4` is an edge of its own, no copy
    fresh.store = FakeStore(BIG)
    node = fresh.restore(fresh.root, copy.span, copy)
    assert node.path_tokens() == (1, 2, 3, 4) and node.stored is copy
    assert copy.tokens == (3, 4)
    check_invariants(fresh)


def test_a_span_copy_an_edge_made_since_runs_past_is_the_split_heads_file():
    """A chat sent while the tree is rebuilt after a restart goes on past a stored system
    prompt's copy: its edge is split at the copy's end, and the head, saved anew from
    memory, is the same path, so the same key and file: the copies below it find their
    parent (refused, the whole folder was deleted)."""
    old, store = tiered()
    old.put([1, 2])
    old.insert(old.match([1, 2]).node, [3, 4], span([3, 4], prefix=(1, 2)))
    top, below = store.saved
    fresh, fresh_store = tiered()
    fresh.put([1, 2, 5, 6])
    (live,) = fresh_store.saved
    restored, rejected = fresh.restore_all(
        [("root", top.span, top), (top.key, below.span, below)])
    assert (restored, rejected) == (1, [])  # `top` is superseded, not deleted
    assert edges(fresh) == {(1, 2), (1, 2, 3, 4), (1, 2, 5, 6)}
    head = fresh.match([1, 2]).node
    assert head.stored.key == top.key and head.handle is not None and not head.on_disk
    assert fresh.match([1, 2, 3, 4]).disk[0].stored is below
    assert live.discarded and {c.path for c in fresh_store.live()} == {(1, 2), (1, 2, 5, 6)}


def test_a_span_copy_an_edge_made_since_leaves_midway_hangs_its_rest_where_they_part():
    """A chat after a restart with another system prompt parts inside a stored one: the
    live edge is split where they part, and the copy's rest hangs there."""
    old, store = tiered()
    old.put([1, 2, 3])
    old.insert(old.match([1, 2, 3]).node, [4], span([4], prefix=(1, 2, 3)))
    top, below = store.saved
    fresh, _ = tiered()
    fresh.put([1, 2, 9])
    restored, rejected = fresh.restore_all(
        [("root", top.span, top), (top.key, below.span, below)])
    assert (restored, rejected) == (2, [])
    assert edges(fresh) == {(1, 2), (1, 2, 9), (1, 2, 3), (1, 2, 3, 4)}
    assert fresh.match([1, 2, 3, 4]).disk == [fresh.match([1, 2, 3]).disk[0],
                                               fresh.match([1, 2, 3, 4]).disk[1]]
    assert top.tokens == (3,) and below.tokens == (4,)


def test_a_copy_whose_key_is_not_its_paths_is_refused():
    old, store = tiered()
    old.put([1, 2, 3])
    (copy,) = store.saved
    fresh, _ = tiered()
    assert fresh.restore(fresh.root, (1, 2, 4), copy) is None
    assert edges(fresh) == set()


def test_sibling_snapshot_copies_below_a_junction_without_state_are_both_restored():
    """Two chats of a sliding-window model part after a prefix whose junction holds no
    state: both copies follow the root and start alike, and the second splits the first's
    edge where they part (refused, every sibling but one was deleted at each restart)."""
    old, store = tiered()
    old.put([1, 2, 3, 4], splittable=False)
    old.put([1, 2, 7, 8], splittable=False)
    first, second = store.saved
    fresh, _ = tiered()
    restored, rejected = fresh.restore_all(
        [("root", first.span, first), ("root", second.span, second)])
    assert (restored, rejected) == (2, [])
    assert edges(fresh) == {(1, 2), (1, 2, 3, 4), (1, 2, 7, 8)}
    assert fresh.match([1, 2, 7, 8]).disk[-1].stored is second
    assert fresh.match([1, 2, 3, 4]).disk[-1].stored is first


def test_a_snapshot_copy_is_restored_at_its_end_whatever_the_edges_above_it():
    old, store = tiered()
    old.put([1, 2, 3, 4], splittable=False)
    (copy,) = store.saved
    fresh, _ = tiered()
    fresh.put([1, 2], splittable=False)
    node = fresh.restore(fresh.root, copy.span, copy)
    assert node.path_tokens() == (1, 2, 3, 4) and node.stored is copy
    check_invariants(fresh)


# -- why a prefix missed -------------------------------------------------------------


def test_a_miss_in_an_empty_tree_is_not_seen_and_a_whole_hit_is_no_miss():
    tree = Tree()
    assert tree.explain_miss([1, 2, 3], 0) == Miss(0, MissReason.NOT_SEEN)
    tree.put([1, 2, 3])
    assert tree.explain_miss([1, 2, 3], 3) is None


def test_a_miss_where_a_cached_branch_goes_on_otherwise_is_diverged_with_its_tokens():
    tree = Tree()
    tree.put([1, 2, 3, 4, 5])
    assert tree.explain_miss([1, 2, 9, 9], 2) == Miss(2, MissReason.DIVERGED, (3, 4, 5))
    tree.match([1, 2, 3])  # now a node boundary at 3; the branch is its child's edge
    assert tree.explain_miss([1, 2, 3, 7], 3) == Miss(3, MissReason.DIVERGED, (4, 5))


def test_a_miss_where_a_branch_was_evicted_or_cleared_says_so():
    tree, _ = tiered(capacity=3)
    tree.put([1, 2, 3])
    tree.evict(3)  # demoted: still on disk, no miss to explain there
    evict_disk(tree, 3)
    assert tree.explain_miss([1, 2, 3, 4], 0) == Miss(0, MissReason.EVICTED_DISK)
    memory_only = Tree()
    memory_only.put([5, 6])
    memory_only.evict(2)
    assert memory_only.explain_miss([5, 6], 0) == Miss(0, MissReason.EVICTED_MEMORY)
    memory_only.put([5, 6])
    memory_only.clear()
    assert memory_only.explain_miss([5, 6, 7], 0) == Miss(0, MissReason.CLEARED)
    memory_only.put([5, 6])  # cached again: a later miss below it is another story
    assert memory_only.explain_miss([5, 6, 7], 2) == Miss(2, MissReason.NOT_SEEN)


def test_a_miss_inside_tokens_another_request_is_computing_is_in_flight():
    tree = Tree()
    parent = tree.match([1, 2, 3]).node
    tree.pin(parent)
    tree.reserve(parent, [1, 2, 3])
    assert tree.explain_miss([1, 2, 3, 4], 0) == Miss(0, MissReason.IN_FLIGHT)


def test_a_snapshot_path_without_state_where_the_prompt_goes_on_is_no_snapshot():
    tree = Tree()
    tree.put([1, 2, 3, 4], splittable=False)
    tree.insert(tree.root, [1, 2, 7], snap([1, 2, 7]))  # splits off a junction `1, 2`
    assert tree.explain_miss([1, 2, 8], 0) == Miss(0, MissReason.NO_SNAPSHOT)


def test_what_a_stop_loses_is_explained_as_reloaded_by_the_next_process():
    tree, store = tiered()
    store.full = True  # no copy: memory only
    tree.put([1, 2, 3])
    store.full = False
    tree.put([7, 8])  # copied: a restart restores it
    entries = tree.departures_at_stop()
    fresh, _ = tiered()
    fresh.remember_departures(entries)
    assert fresh.explain_miss([1, 2, 3, 4], 0) == Miss(0, MissReason.RELOADED)
    assert fresh.explain_miss([7, 8, 9], 0) == Miss(0, MissReason.NOT_SEEN)
