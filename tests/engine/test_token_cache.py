"""Prompt tokenization cached in segments (engine/token_cache.py): the ids are always the
tokenizer's own for the whole text, cold and warm, on the tokenizers the project ships
(the demo model's and SmolLM2's byte-level BPEs here, Gemma 3's SentencePiece BPE in
test_token_cache_gemma.py); a tokenizer whose encoding cannot be cut is not cached, and
cutting it would have changed tokens; the cache stays within its bound."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_wrapper
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.model_source import default_model_file
from engine.token_cache import NotCacheable, SegmentCache, cut_tokens
from engine.tokenizer import ModelTokenizer
from tests.engine.gguf_files import write_gguf_tokenizer
from tests.engine.token_cache_checks import (
    TOOLS,
    check_cached_encoding,
    check_chat_prompts,
    check_prompt_encoding,
    encoder,
)

CHATML = ("<|im_end|>", "<|im_start|>")


@pytest.fixture(scope="module", params=["demo", "smollm2"])
def wrapper(request, demo_model_dir: Path, tmp_path_factory) -> TokenizerWrapper:
    """mlx-lm's wrapper of a shipped tokenizer: the demo model's, or the default model's
    (SmolLM2-135M-Instruct, from its GGUF, as the server converts it)."""
    if request.param == "demo":
        return load_wrapper(demo_model_dir)
    return load_wrapper(write_gguf_tokenizer(
        default_model_file(), tmp_path_factory.mktemp("smollm2-tokenizer")))


def test_the_shipped_tokenizers_cut_after_their_turn_markers(wrapper) -> None:
    assert cut_tokens(wrapper._tokenizer) == CHATML


def test_cut_segments_encode_as_the_whole_text(wrapper) -> None:
    check_cached_encoding(wrapper, seed=1)


def test_prompts_encode_as_the_tokenizer_encodes_them(wrapper) -> None:
    check_prompt_encoding(wrapper, seed=2)


def test_chat_prompts_are_the_templates_tokens(wrapper) -> None:
    check_chat_prompts(wrapper, seed=3)


def test_each_turn_of_an_agents_conversation_is_the_templates_tokens(wrapper) -> None:
    """A long system prompt and tools, then turns added one by one, each prompt rendered
    twice (the second from segments the first cached, as the next request would be)."""
    tokenizer = ModelTokenizer(wrapper)
    system = " ".join(f"Rule {n}: answer as a lighthouse keeper would." for n in range(150))
    call = {"type": "function", "function": {"name": "get_weather",
                                             "arguments": {"city": "Paris"}}}
    turns = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": '{"sky": "clear", "wind": "12 km/h"}'},
             {"role": "assistant", "content": "Clear skies.<|im_end|> (it said so)"},
             {"role": "user", "content": "And  in\tBrest?\n\n"}]
    messages = [{"role": "system", "content": system}]
    for turn in turns:
        messages.append(turn)
        expected = wrapper.apply_chat_template(messages, tools=TOOLS, tokenize=True,
                                               add_generation_prompt=True)
        for _ in ("cold", "warm"):
            assert tokenizer.chat_prompt(messages, TOOLS) == list(expected)


# -- tokenizers whose encoding cannot be cut -------------------------------------------

VOCAB = {"[UNK]": 0, "\u2581": 1, "\u2581a": 2, "a": 3, "\u2581b": 4, "b": 5}


def sentencepiece_like(prepend_scheme: str = "always", *added: AddedToken,
                       split_special_tokens: bool = False) -> TokenizerWrapper:
    """A word-level SentencePiece-style tokenizer (spaces as ▁, Metaspace) with `added`
    tokens and a chat template that writes <|im_end|>, in mlx-lm's wrapper."""
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    backend.add_special_tokens([*added] or [AddedToken("<|im_end|>", special=True,
                                                       normalized=False)])
    hf = PreTrainedTokenizerFast(tokenizer_object=backend,
                                 split_special_tokens=split_special_tokens)
    hf.chat_template = "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"
    return TokenizerWrapper(hf)


def im_end(**flags: bool) -> AddedToken:
    return AddedToken("<|im_end|>", special=True, normalized=False, **flags)


def test_a_tokenizer_that_can_be_cut_is_cut() -> None:
    """The contrast for the cases below: the same tokenizer, prepending ▁ to every piece."""
    wrapper = sentencepiece_like("always")
    assert cut_tokens(wrapper._tokenizer) == ("<|im_end|>",)
    text = "a<|im_end|>b  b<|im_end|> a"
    cache = SegmentCache(encoder(wrapper), ("<|im_end|>",), min_chars=1)
    assert cache.encode(text) == wrapper.encode(text, add_special_tokens=False)


BREAKS = {
    # ▁ only before the piece at offset 0 of the whole text: "b" after the cut would get one.
    "Metaspace first": (lambda: sentencepiece_like("first"), "a<|im_end|>b", "Metaspace"),
    # "<|im_end|>\n" is matched whole: cutting after <|im_end|> splits it.
    "overlapping token": (lambda: sentencepiece_like(
        "always", im_end(), AddedToken("<|im_end|>\n", special=True, normalized=False)),
        "a<|im_end|>\nb", "inside the added token"),
    # rstrip takes the spaces after <|im_end|> into it.
    "rstrip": (lambda: sentencepiece_like("always", im_end(rstrip=True)), "a<|im_end|>  b",
               "strips spaces"),
    # Special tokens encoded as text: <|im_end|> is no boundary at all.
    "split_special_tokens": (lambda: sentencepiece_like("always", split_special_tokens=True),
                             "a<|im_end|>b", "split_special_tokens"),
}


@pytest.mark.parametrize("case", BREAKS)
def test_a_tokenizer_whose_encoding_cannot_be_cut_is_not_cached(case: str) -> None:
    """`cut_tokens` refuses it, cutting it anyway would change tokens, and the server's
    tokenizer on it gives the tokenizer's own ids."""
    make, text, reason = BREAKS[case]
    wrapper = make()
    with pytest.raises(NotCacheable, match=reason):
        cut_tokens(wrapper._tokenizer)
    plain = wrapper.encode(text, add_special_tokens=False)
    naive = SegmentCache(encoder(wrapper), ("<|im_end|>",), min_chars=1)
    assert naive.encode(text) != plain
    tokenizer = ModelTokenizer(wrapper)
    for _ in ("cold", "warm"):
        assert tokenizer.encode(text, special_tokens=False) == plain
        # The model's own message: its markers stay markers (engine/control_tokens.py).
        reply = [{"role": "assistant", "content": text}]
        assert tokenizer.chat_prompt(reply, end="as_is") == \
            wrapper.apply_chat_template(reply, tokenize=True)


# -- the bound and concurrent callers ----------------------------------------------------


class CountingEncoder:
    """Encodes each character as its code point (so any cut is exact) and counts the
    texts it was asked for."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def __call__(self, texts: list[str]) -> list[list[int]]:
        self.texts += texts
        return [[ord(char) for char in text] for text in texts]


def test_the_cache_never_holds_more_than_its_bound() -> None:
    rng = random.Random(4)
    cache = SegmentCache(CountingEncoder(), ("|",), max_chars=500, min_chars=1)
    for _ in range(300):
        text = "|".join("x" * rng.randint(0, 80) for _ in range(rng.randint(1, 6)))
        assert cache.encode(text) == [ord(char) for char in text]
        assert cache.chars <= 500
    assert cache.chars > 400, "it does fill up"


def test_the_least_recently_used_segment_goes_first() -> None:
    encoder = CountingEncoder()
    cache = SegmentCache(encoder, ("|",), max_chars=30, min_chars=1)
    cache.encode("a" * 9 + "|" + "b" * 9 + "|")  # two segments of 10
    cache.encode("a" * 9 + "|")  # a is used again: b is now the oldest
    cache.encode("c" * 9 + "|" + "d" * 9 + "|")  # 40 characters: one must go
    encoder.texts.clear()
    cache.encode("a" * 9 + "|" + "b" * 9 + "|")
    assert encoder.texts == ["b" * 9 + "|"]


def test_short_groups_and_texts_longer_than_the_bound_are_encoded_not_kept() -> None:
    encoder = CountingEncoder()
    cache = SegmentCache(encoder, ("|",), max_chars=100, min_chars=8)
    text = "ab|cd|" + "e" * 20 + "|" + "f" * 200 + "|g"
    for _ in ("cold", "warm"):
        assert cache.encode(text) == [ord(char) for char in text]
    # Grouped to 8 or more: "ab|cd|eee…|" is kept, the 201 f's exceed the bound, "g" is short.
    assert encoder.texts == ["ab|cd|" + "e" * 20 + "|", "f" * 200 + "|", "g",
                             "f" * 200 + "|", "g"]
    assert cache.chars == 27


def test_concurrent_callers_get_exact_ids_within_the_bound() -> None:
    cache = SegmentCache(CountingEncoder(), ("|",), max_chars=2000, min_chars=1)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            text = "|".join(rng.choice("xyz") * rng.randint(1, 40) for _ in range(5))
            if cache.encode(text) != [ord(char) for char in text] or cache.chars > 2000:
                errors.append(text)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
