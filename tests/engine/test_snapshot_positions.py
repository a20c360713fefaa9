"""Where a sliding-window or hybrid model's prefill snapshots its whole cache state: at
message ends worth the forward each one splits the prefill into."""

from __future__ import annotations

from engine.scheduler import MAX_MESSAGE_SNAPSHOTS, spaced_snapshots


def test_every_message_end_inside_the_unfed_prompt_without_a_minimum_span() -> None:
    # The cached prefix's own end and the prompt's end are snapshotted anyway.
    assert spaced_snapshots([10, 40, 41, 90, 100], depth=10, end=100, min_span=0) == [
        40, 41, 90]


def test_message_ends_close_to_the_snapshot_before_them_are_skipped() -> None:
    # A turn behind a cached history: its repeated reply and its question each end a
    # message a few dozen tokens apart, and the generation prompt follows.
    assert spaced_snapshots([1000, 1034, 1090], depth=1000, end=1094, min_span=256) == []
    # Long turns keep theirs: spans count from the last one kept.
    ends = [1200, 1300, 1600, 1700, 2100]
    assert spaced_snapshots(ends, depth=0, end=2400, min_span=256) == [1200, 1600, 2100]


def test_a_long_system_prompt_is_snapshotted_however_short_the_turn_after_it() -> None:
    # What other conversations share is the system prompt: a short first question after
    # it does not make its snapshot worth less.
    assert spaced_snapshots([1000, 1040], depth=0, end=1044, min_span=256) == [1000]


def test_at_most_the_first_and_the_last_message_ends() -> None:
    ends = list(range(100, 1100, 100))
    positions = spaced_snapshots(ends, depth=0, end=2000, min_span=0)
    assert len(positions) == MAX_MESSAGE_SNAPSHOTS
    assert positions == [100, *ends[1 - MAX_MESSAGE_SNAPSHOTS:]]
