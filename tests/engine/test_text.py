"""Incremental detokenization and stop strings (engine/text.py), token by token, with the
demo model's byte-level BPE tokenizer: through `tokenizers`' DecodeStream, and through
the window decoder used for tokenizers without a fast backend."""

from __future__ import annotations

import copy

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from engine.text import StopPrefix, TextStream
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
           prompt: str = "Say it:", min_tokens: int = 0) -> tuple[TextStream, list[str]]:
    """A TextStream after `text`'s tokens, and what each token released."""
    text_stream = TextStream(tokenizer, tokenizer.encode(prompt), stop, min_tokens)
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


def test_a_prompt_that_ends_inside_a_character_shows_only_the_reply(tokenizer) -> None:
    """A token prompt cut to a budget can end partway through a character. Seeded with
    it, DecodeStream showed the prompt's own last words with the reply's first token, and
    the window decoder lost the reply's first character."""
    prompt = tokenizer.encode(f"Say {EMOJI}", special_tokens=False)[:-1]
    text_stream = TextStream(tokenizer, prompt, ())
    reply = tokenizer.encode(" ok, a reply", special_tokens=False)
    text = "".join(text_stream.add(token) for token in reply) + text_stream.finish()
    assert text == " ok, a reply"
    # A reply that ends the prompt's character has only that character's last bytes.
    text_stream = TextStream(tokenizer, prompt, ())
    reply = tokenizer.encode(f"Say {EMOJI} ok", special_tokens=False)[len(prompt):]
    text = "".join(text_stream.add(token) for token in reply) + text_stream.finish()
    assert text == "\ufffd ok"


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
    assert "".join(chunks) == " hello ", "'wor' could start 'world!'"
    assert text_stream.matched_stop is None
    assert text_stream.finish() == "wor"


def test_a_long_stop_string_holds_back_only_what_could_start_it(tokenizer) -> None:
    """A 200-character stop string held every reply back until it ended."""
    text = " hello world and more"
    _, chunks = stream(tokenizer, text, stop=("Q" * 200,))
    assert chunks == [piece for piece in chunks if piece] and "".join(chunks) == text
    _, chunks = stream(tokenizer, " hello QQ", stop=("Q" * 200,))
    assert "".join(chunks) == " hello "


@given(st.text("ab", max_size=12), st.lists(st.text("abc", max_size=5), max_size=8))
def test_a_stop_prefix_is_the_longest_start_of_the_stop_string_the_text_ends_with(
        stop: str, pieces: list[str]) -> None:
    assume(stop)
    prefix, text = StopPrefix(stop), ""
    for piece in pieces:
        text += piece
        assert prefix.feed(piece) == max(k for k in range(len(stop) + 1)
                                         if text.endswith(stop[:k]))


def test_a_stop_string_begun_in_the_first_min_tokens_and_ended_after_them_matches(
        tokenizer) -> None:
    """vLLM's stop checker looks for a stop string in the text after the first
    `min_tokens` tokens and the stop string's length less one before it: one that begins
    in those tokens and ends after them stops the reply, one wholly inside them does not.
    The text it begins with is held back as any text that may begin a stop string is."""
    text = " hello world and more"
    first = tokenizer.encode(" hello", special_tokens=False)
    assert tokenizer.encode(text, special_tokens=False)[:len(first)] == first
    text_stream, chunks = stream(tokenizer, text, stop=("lo wo",), min_tokens=len(first))
    assert text_stream.matched_stop == "lo wo" and "".join(chunks) == " hel"
    text_stream, chunks = stream(tokenizer, text, stop=("ello",), min_tokens=len(first))
    assert text_stream.matched_stop is None
    assert "".join(chunks) + text_stream.finish() == text


def test_the_earliest_of_several_stop_strings_wins(tokenizer) -> None:
    text_stream, chunks = stream(tokenizer, " hello world", stop=("world", "llo"))
    assert "".join(chunks) == " he" and text_stream.matched_stop == "llo"
    assert text_stream.add(tokenizer.encode("!", special_tokens=False)[0]) == ""


def test_token_bytes_are_the_pieces_own_bytes(demo_model_dir) -> None:
    """Logprob bytes: joined, a character's tokens give its UTF-8 bytes, though each
    alone decodes to U+FFFD; an added token is its text."""
    tokenizer = ModelTokenizer(load_tokenizer(demo_model_dir))
    tokens = tokenizer.encode(f" {EMOJI}", special_tokens=False)
    assert [tokenizer.decode([t]) for t in tokens][1:] == ["\ufffd", "\ufffd"]
    assert [tokenizer.token_logprob(t, 0).bytes for t in tokens] == [b" \xf0\x9f", b"\x98", b"\x80"]
    im_end = tokenizer.encode("<|im_end|>", special_tokens=False)
    assert [tokenizer.token_logprob(t, 0).bytes for t in im_end] == [b"<|im_end|>"]


def test_sentencepiece_byte_pieces_are_their_byte() -> None:
    """A SentencePiece-style vocabulary with byte fallback (Llama 2, Mistral, Gemma)."""
    vocab = {"<unk>": 0, "<0xF0>": 1, "<0x9F>": 2, "\u2581hi": 3}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True,
                                   unk_token="<unk>"))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = ModelTokenizer(TokenizerWrapper(PreTrainedTokenizerFast(
        tokenizer_object=backend)))
    assert [tokenizer.token_logprob(t, 0).bytes for t in (1, 2, 3)] == [b"\xf0", b"\x9f", b" hi"]
