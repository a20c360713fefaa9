"""Incremental detokenization and stop strings (engine/text.py), token by token, with the
demo model's byte-level BPE tokenizer: through `tokenizers`' DecodeStream, and through
the window decoder used for tokenizers without a fast backend."""

from __future__ import annotations

import copy

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.text import TextStream
from engine.tokenizer import ModelTokenizer

EMOJI = "\U0001f600"  # 4 UTF-8 bytes, 3 tokens of the demo tokenizer


@pytest.fixture(scope="module", params=["stream", "window"])
def tokenizer(request, demo_model_dir) -> ModelTokenizer:
    tokenizer = ModelTokenizer(load_tokenizer(demo_model_dir))
    if request.param == "window":
        tokenizer = copy.copy(tokenizer)
        tokenizer.fast = None
    return tokenizer


def stream(tokenizer: ModelTokenizer, text: str, stop: tuple[str, ...] = (),
           prompt: str = "Say it:") -> tuple[TextStream, list[str]]:
    """A TextStream after `text`'s tokens, and what each token released."""
    text_stream = TextStream(tokenizer, tokenizer.encode(prompt), stop)
    chunks = [text_stream.add(token) for token in tokenizer.encode(text, special_tokens=False)]
    return text_stream, chunks


def test_streamed_text_is_the_whole_decode(tokenizer) -> None:
    text = f" naïve café {EMOJI} and more"
    text_stream, chunks = stream(tokenizer, text)
    assert "".join(chunks) + text_stream.finish() == text
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_a_character_split_across_tokens_appears_once_whole(tokenizer) -> None:
    assert len(tokenizer.encode(f" {EMOJI}", special_tokens=False)) == 3
    _, chunks = stream(tokenizer, f" {EMOJI}")
    assert chunks == ["", "", f" {EMOJI}"]


def test_an_incomplete_character_at_the_end_shows_as_a_replacement(tokenizer) -> None:
    first = tokenizer.encode(EMOJI, special_tokens=False)[0]
    text_stream = TextStream(tokenizer, tokenizer.encode("Say it:"), ())
    assert text_stream.add(first) == ""
    assert text_stream.finish() == "\ufffd"


def test_the_first_token_keeps_its_leading_space(tokenizer) -> None:
    _, chunks = stream(tokenizer, " hello world")
    assert chunks[0].startswith(" ") and "".join(chunks) == " hello world"


def test_a_stop_string_split_across_tokens_is_never_emitted(tokenizer) -> None:
    text_stream, chunks = stream(tokenizer, " hello world and more", stop=("lo wo",))
    assert len(tokenizer.encode(" hello world", special_tokens=False)) > 2, "split"
    assert "".join(chunks) == " hel"
    assert text_stream.matched_stop == "lo wo"
    assert text_stream.finish() == "", "nothing after a stop string is shown"


def test_text_that_may_start_a_stop_string_waits_then_is_released(tokenizer) -> None:
    text_stream, chunks = stream(tokenizer, " hello wor", stop=("world!", "xyz"))
    assert "".join(chunks) == " hell", "the last 5 characters could start 'world!'"
    assert text_stream.matched_stop is None
    assert text_stream.finish() == "o wor"


def test_the_earliest_of_several_stop_strings_wins(tokenizer) -> None:
    text_stream, chunks = stream(tokenizer, " hello world", stop=("world", "llo"))
    assert "".join(chunks) == " he" and text_stream.matched_stop == "llo"
    assert text_stream.add(tokenizer.encode("!", special_tokens=False)[0]) == ""
