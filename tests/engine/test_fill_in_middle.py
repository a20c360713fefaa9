"""Which vocabularies fill in the middle, and the prompt they are given (no MLX)."""

from __future__ import annotations

import pytest

from engine.fill_in_middle import (
    MARKERS,
    PREFIX_TOKENS,
    SUFFIX_FIRST,
    SUFFIX_TOKENS,
    FillInMiddleTokens,
    find_tokens,
    infill_prompt,
)


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one id per character, above the control tokens."""
    return [1000 + ord(character) for character in text]


@pytest.mark.parametrize("names", MARKERS, ids=[names[0] for names in MARKERS])
def test_each_familys_tokens_are_found_by_their_text(names: tuple[str, str, str]) -> None:
    vocabulary = {"hello": 5, names[0]: 10, names[1]: 11, names[2]: 12}
    assert find_tokens(vocabulary.get) == FillInMiddleTokens(10, 11, 12, names=names)


def test_a_vocabulary_without_a_whole_set_does_not_fill_in_the_middle() -> None:
    # SmolLM2's vocabulary has StarCoder's file separator and repository name, no prefix.
    assert find_tokens({"<file_sep>": 3, "<repo_name>": 4, "<fim_prefix>": 5}.get) is None


def test_a_middle_ends_at_what_starts_another_file_or_pads() -> None:
    tokens = find_tokens({"<|fim_prefix|>": 1, "<|fim_suffix|>": 2, "<|fim_middle|>": 3,
                          "<|fim_pad|>": 4, "<|repo_name|>": 5, "<|file_sep|>": 6}.get)
    assert tokens is not None and sorted(tokens.ends) == [4, 5, 6]


def test_files_go_before_the_prefix_as_a_repository() -> None:
    tokens = FillInMiddleTokens(1, 2, 3, repository=5, file_separator=6)
    prompt = infill_prompt(tokens, encode, "ab", "c", [("u", "x")], head=[9])
    assert prompt == [9, 5, *encode("myproject\n"), 6, *encode("u\n"), *encode("x"),
                      6, *encode("filename\n"), 1, *encode("ab"), 2, *encode("c"), 3]
    assert infill_prompt(tokens, encode, "ab", "c") == [1, *encode("ab"), 2, *encode("c"), 3]


def test_without_a_file_separator_files_are_text_apart() -> None:
    tokens = FillInMiddleTokens(1, 2, 3)
    assert infill_prompt(tokens, encode, "a", "b", [("u", "x"), ("v", "y")]) == [
        *encode("\n\nx"), *encode("\n\ny"), 1, *encode("a"), 2, *encode("b"), 3]


def test_codellamas_middle_ends_at_its_own_token() -> None:
    tokens = find_tokens({"▁<PRE>": 32007, "▁<SUF>": 32008, "▁<MID>": 32009,
                          "▁<EOT>": 32010}.get)
    assert tokens is not None and tokens.ends == (32010,)


def test_a_fitted_prompt_keeps_the_code_nearest_the_gap_and_the_latest_files() -> None:
    """As llama.cpp's /infill: the prefix's end, the suffix's start, then as much of the
    files' context, from its end, as the rest of the room holds."""
    tokens = FillInMiddleTokens(1, 2, 3)
    prefix, suffix = "p" * (PREFIX_TOKENS + 10), "s" * (SUFFIX_TOKENS + 10)
    prompt = infill_prompt(tokens, encode, prefix, suffix, [("u", "old" + "x" * 5000)],
                           fit=3000)
    assert len(prompt) == 3000
    assert prompt[-(SUFFIX_TOKENS + 2):] == [2, *encode("s" * SUFFIX_TOKENS), 3]
    files = 3000 - PREFIX_TOKENS - SUFFIX_TOKENS - 3
    assert prompt[:files] == encode("x" * files)
    assert prompt[files:files + PREFIX_TOKENS + 1] == [1, *encode("p" * PREFIX_TOKENS)]
    # Less room than the code itself: no files at all, the code as cut.
    assert infill_prompt(tokens, encode, prefix, suffix, [("u", "x")], fit=10) == [
        1, *encode("p" * PREFIX_TOKENS), 2, *encode("s" * SUFFIX_TOKENS), 3]


def test_codestral_is_prompted_suffix_first() -> None:
    """mistral-common's `encode_fim`: `[SUFFIX] suffix [PREFIX] prefix`, and the middle
    follows the prefix; another gap's tokens end it. The project's files go first."""
    tokens = find_tokens({"[INST]": 3, "[PREFIX]": 7, "[SUFFIX]": 8}.get)
    assert tokens == FillInMiddleTokens(7, 8, None, names=SUFFIX_FIRST)
    assert tokens.suffix_first and tokens.ends == (7, 8)
    assert infill_prompt(tokens, encode, "ab", "c", [("u", "x")], head=[9]) == [
        9, *encode("\n\nx"), 8, *encode("c"), 7, *encode("ab")]


def test_a_suffix_first_suffix_goes_on_from_before_it() -> None:
    """A SentencePiece tokenizer puts a word-start space (here 0) before a text; the
    suffix is encoded without it, as mistral-common's `_encode_infilling` does."""
    def sentencepiece(text: str) -> list[int]:
        return [0, *encode(text)]

    tokens = FillInMiddleTokens(7, 8, None)
    assert infill_prompt(tokens, sentencepiece, "ab", "c") == [
        8, *encode("c"), 7, 0, *encode("ab")]


def test_a_fitted_suffix_first_prompt_fills_the_room() -> None:
    tokens = FillInMiddleTokens(7, 8, None)
    prompt = infill_prompt(tokens, encode, "p" * 100, "s" * 100, [("u", "x" * 5000)],
                           fit=1000)
    assert len(prompt) == 1000
    assert prompt[-101:] == [7, *encode("p" * 100)]
