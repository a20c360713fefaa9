"""A request's hold on the radix tree (engine/tree_hold.py), on a real tree with fake
handles: every way a hold starts and ends leaves the tree's accounting whole and nothing
pinned."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.tree_hold import TreeHold
from radix import Node, NodeState, RadixTree, ReserveStatus
from tests.radix.support import FakeHandle, check_invariants

PROMPT = (1, 2, 3, 4, 5, 6)


def handles_of(tokens: Sequence[int]):
    """The caller's HandleOf for a request whose cache holds `tokens`."""
    return lambda start, end: FakeHandle(tokens[start:end], prefix=tokens[:start])


@pytest.fixture
def tree() -> RadixTree:
    return RadixTree(1 << 20, FakeHandle.free)


def watch(node: Node) -> list[Node]:
    """Gets `node` once it is done: READY, or POISONED with its error."""
    done: list[Node] = []
    node.add_done_callback(done.append)
    return done


def started(tree: RadixTree, tokens: Sequence[int] = PROMPT) -> TreeHold:
    hold = TreeHold(tree)
    assert hold.start(tree.match(tokens), tokens) is None
    return hold


def test_a_cold_start_pins_the_root_and_reserves_the_whole_prompt(tree: RadixTree) -> None:
    hold = started(tree)
    assert (hold.node, hold.depth) == (tree.root, 0)
    assert hold.reservation.state is NodeState.PENDING and hold.reservation.tokens == PROMPT
    assert tree.stats().pending == 1
    check_invariants(tree)


def test_publish_finalizes_the_reservation_and_wakes_its_waiters(tree: RadixTree) -> None:
    hold = started(tree)
    done = watch(hold.reservation)
    assert hold.publish(PROMPT, len(PROMPT), handles_of(PROMPT)) is None
    assert [node.state for node in done] == [NodeState.READY] and hold.reservation is None
    assert hold.depth == len(PROMPT) and hold.node.handle.path == PROMPT
    assert tree.stats().pinned_tokens == len(PROMPT)
    check_invariants(tree)


def test_publishes_says_whether_a_publish_would_insert_anything(tree: RadixTree) -> None:
    """A reservation to fill, or tokens past the held prefix: the scheduler reads a
    prompt's KV only then (a classify list's prompts behind a cached instruction have
    neither)."""
    first = started(tree)
    assert first.publishes(len(PROMPT))  # its reservation
    first.publish(PROMPT, len(PROMPT), handles_of(PROMPT))
    first.release(PROMPT, handles_of(PROMPT))
    again = started(tree, PROMPT + (7,))  # holds the whole of PROMPT now
    assert again.reservation is not None and again.publishes(len(PROMPT))
    again.abandon(RuntimeError("cancelled"))
    hold = TreeHold(tree)
    assert hold.start(tree.match(PROMPT), PROMPT) is None  # all cached: no reservation
    assert hold.reservation is None and hold.depth == len(PROMPT)
    assert not hold.publishes(len(PROMPT)) and not hold.publishes(3)
    assert hold.publish(PROMPT, len(PROMPT), lambda start, end: pytest.fail("read")) is None
    hold.release(PROMPT, None)
    check_invariants(tree)


def test_release_inserts_what_was_generated_and_unpins_everything(tree: RadixTree) -> None:
    hold = started(tree)
    hold.publish(PROMPT, len(PROMPT), handles_of(PROMPT))
    everything = (*PROMPT, 7, 8)
    hold.release(everything, handles_of(everything))
    stats = tree.stats()
    assert (stats.total_tokens, stats.pinned_bytes, stats.pending) == (8, 0, 0)
    assert tree.match(everything).length == 8
    assert hold.node is None
    check_invariants(tree)


def test_release_before_the_prompt_was_computed_gives_its_reservation_up(tree: RadixTree) -> None:
    hold = started(tree)
    done = watch(hold.reservation)
    hold.release((), None)
    assert [node.state for node in done] == [NodeState.POISONED]
    assert tree.stats().total_tokens == tree.stats().pending == 0
    check_invariants(tree)


def test_abandon_hands_its_error_to_the_waiters_and_shares_nothing(tree: RadixTree) -> None:
    hold = started(tree)
    done = watch(hold.reservation)
    failure = RuntimeError("forward pass failed")
    hold.abandon(failure)
    assert [node.error for node in done] == [failure]
    assert (tree.stats().total_tokens, tree.stats().pinned_bytes) == (0, 0)
    check_invariants(tree)


def test_a_prefix_someone_is_computing_is_not_reserved_twice(tree: RadixTree) -> None:
    first = started(tree)
    second = TreeHold(tree)
    match = tree.match(PROMPT)
    assert match.in_flight is first.reservation
    assert second.start(match, PROMPT) is None
    assert (second.node, second.reservation) == (tree.root, None)
    check_invariants(tree)


def test_a_stale_match_holds_nothing_and_says_wait(tree: RadixTree) -> None:
    stale = tree.match(PROMPT)
    first = started(tree)
    second = TreeHold(tree)
    outcome = second.start(stale, PROMPT)
    assert (outcome.status, outcome.node) == (ReserveStatus.WAIT, first.reservation)
    assert second.node is None
    first.abandon(RuntimeError("done"))
    assert tree.stats().pinned_bytes == 0
    check_invariants(tree)


def test_publishing_into_anothers_reservation_stops_short_and_names_it(
    tree: RadixTree,
) -> None:
    """Computed without a reservation, a prompt whose path runs into another's
    reservation is published up to it; the rest follows once that one is done."""
    other = started(tree, (1, 2, 3, 9, 9))
    longer = (*PROMPT, 7)
    hold = TreeHold(tree)
    assert hold.start(tree.match(longer), longer) is None and hold.reservation is None
    blocker = hold.publish(longer, len(longer), handles_of(longer))
    assert blocker is other.reservation and hold.depth < len(longer)
    other.abandon(RuntimeError("gone"))
    hold.release(longer, handles_of(longer))
    assert tree.stats().pinned_bytes == 0
    check_invariants(tree)
