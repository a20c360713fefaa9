"""Thinking split from the answer as text arrives in pieces."""

from __future__ import annotations

import pytest

from server.reasoning import ReasoningSplitter


def _run(pieces: list[str], inside: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter("<think>", "</think>", inside)
    reasoning = answer = ""
    for piece in [*pieces, None]:
        more = splitter.close() if piece is None else splitter.feed(piece)
        reasoning, answer = reasoning + more[0], answer + more[1]
    return reasoning, answer


TEXT = "<think>\nWhich city? Paris.\n</think>\n\nParis."


@pytest.mark.parametrize("size", [1, 3, len(TEXT)])
def test_markers_split_across_pieces(size: int) -> None:
    pieces = [TEXT[i:i + size] for i in range(0, len(TEXT), size)]
    assert _run(pieces) == ("\nWhich city? Paris.\n", "Paris.")


def test_prompt_that_opens_the_block_starts_inside() -> None:
    assert _run(["Hmm.</think>", "Yes."], inside=True) == ("Hmm.", "Yes.")


def test_no_thinking_is_all_answer_and_a_lookalike_is_released() -> None:
    assert _run(["a <thin", "king> b"]) == ("", "a <thinking> b")


def test_unfinished_thinking_stays_reasoning() -> None:
    assert _run(["<think>still going"]) == ("still going", "")
