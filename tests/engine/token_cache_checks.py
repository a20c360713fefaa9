"""The checks of a segment-cached tokenizer (engine/token_cache.py) against the tokenizer
itself, on random texts and conversations that stress where it cuts: its cut tokens and
other added tokens, halves of them, white space and unicode right beside them. Every
generator takes a seed, so a failure reproduces."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from jinja2 import TemplateError
from mlx_lm.tokenizer_utils import TokenizerWrapper

from engine.control_tokens import ControlStrings
from engine.token_cache import SegmentCache, cut_tokens
from engine.tokenizer import ModelTokenizer

WORDS = ("hello", " world", "Hello", "user", "assistant", "system", "model", " the", "a",
         "'s", "'ll", "don't", ".", ",", "!?", "...", "```python", "{\"a\": 1}", "->", "_",
         "http://x.io/a?b=1", "__init__", "CamelCase", "snake_case", "#", "**bold**")
SPACES = (" ", "  ", "   ", "\n", "\n\n", "\n\n\n", "\t", "\t\t", " \n", "\n ", "\r\n",
          "\u00a0", "\u3000", "\u2581")
UNICODE = ("é", "e\u0301", "\u0301", "ñ", "ß", "İ", "Ω", "ﬁ", "日本語", "中文", "한국어",
           "\U0001f600", "\U0001f469\u200d\U0001f469\u200d\U0001f467", "\u200d", "\ufeff",
           "Ⅻ", "①", "½", "\U0001d400", "ạ̈")
DIGITS = ("0", "7", "42", "123", "2024-05-01", "3.14159", "1,000,000", "0x1F")


def pieces_around(added_tokens: Sequence[str], cuts: Sequence[str]) -> list[str]:
    """What texts are built of: the tokenizer's cut tokens and some other added tokens,
    whole and cut in two (so joins can form them, or stop one short), and the rest."""
    pieces = [*WORDS, *SPACES, *UNICODE, *DIGITS, *added_tokens, *cuts, *cuts, *cuts]
    for token in (*cuts, *added_tokens[:8]):
        for at in range(1, len(token)):
            pieces += [token[:at], token[at:]]
    return pieces


def random_text(rng: random.Random, pieces: Sequence[str], most: int = 60) -> str:
    """Up to `most` pieces, now and then a long run of words (so that a cache that only
    keeps long segments keeps some)."""
    parts = []
    for _ in range(rng.randint(0, most)):
        if rng.random() < 0.05:
            parts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))))
        else:
            parts.append(rng.choice(pieces))
    return "".join(parts)


def random_texts(seed: int, pieces: Sequence[str], count: int, most: int = 60) -> list[str]:
    rng = random.Random(seed)
    return ["", *(random_text(rng, pieces, most) for _ in range(count))]


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather <|im_end|> of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def random_conversation(rng: random.Random, pieces: Sequence[str],
                        client_text: Callable[[str], str] = str) -> list[dict[str, Any]]:
    """A system message or not (sometimes a long one, as agents send), then user and
    assistant turns alternating (Gemma's template requires it), ending with the user;
    assistants call a tool now and then. The system's and user's texts go through
    `client_text`."""
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.6:
        messages.append({"role": "system",
                         "content": client_text(random_text(rng, pieces, 200))})
    for turn in range(rng.randint(1, 4) * 2 - 1):
        if turn % 2 == 0:
            messages.append({"role": "user",
                             "content": client_text(random_text(rng, pieces, 40))})
            continue
        message: dict[str, Any] = {"role": "assistant", "content": random_text(rng, pieces, 40)}
        if rng.random() < 0.3:
            message["tool_calls"] = [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": random_text(rng, pieces, 3)}}}]
        messages.append(message)
    return messages


def outcome(render: Callable[..., Sequence[int]], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """("ids", what `render(*args, **kwargs)` gives) or ("rejected", the error's type): a
    template may reject a chat, and then both ways of rendering it must."""
    try:
        return "ids", list(render(*args, **kwargs))
    except (TemplateError, ValueError) as error:
        return "rejected", type(error)


def encoder(wrapper: TokenizerWrapper):
    """The tokenizer's own encoding of each of several texts, without special tokens."""
    return lambda texts: wrapper._tokenizer(texts, add_special_tokens=False)["input_ids"]


def stress_pieces(wrapper: TokenizerWrapper, seed: int) -> list[str]:
    """Pieces for random texts: 40 of the tokenizer's added tokens, its cut tokens."""
    added = sorted(wrapper.get_added_vocab())
    sample = random.Random(seed).sample(added, min(40, len(added)))
    return pieces_around(sample, cut_tokens(wrapper._tokenizer))


def check_cached_encoding(wrapper: TokenizerWrapper, seed: int) -> None:
    """Texts through a cache that keeps every segment (cut after every cut token),
    cold, then warm from segments other texts left: each time the tokenizer's ids."""
    cuts = cut_tokens(wrapper._tokenizer)
    cache = SegmentCache(encoder(wrapper), cuts, min_chars=1)
    texts = random_texts(seed, stress_pieces(wrapper, seed), 400)
    for _ in ("cold", "warm"):
        for text in texts:
            assert cache.encode(text) == wrapper.encode(text, add_special_tokens=False), text


def check_prompt_encoding(wrapper: TokenizerWrapper, seed: int) -> None:
    """ModelTokenizer.encode, with and without special tokens, cold and warm; and
    encode_batch of all the texts at once."""
    tokenizer = ModelTokenizer(wrapper)
    texts = random_texts(seed, stress_pieces(wrapper, seed), 150, most=200)
    for _ in ("cold", "warm"):
        for text in texts:
            for special in (False, True):
                expected = wrapper.encode(text, add_special_tokens=special)
                assert tokenizer.encode(text, special_tokens=special) == expected, text
    assert tokenizer.encode_batch(texts) == [wrapper.encode(text) for text in texts]


def check_chat_prompts(wrapper: TokenizerWrapper, seed: int) -> None:
    """chat_prompt is the template's tokenize=True rendering, with tools or not, at every
    end, for random conversations whose contents hold the template's own markers: the
    assistant's messages all of them, the system's and user's none of its control strings
    (a client's are read as text: tests/engine/test_control_tokens.py)."""
    tokenizer = ModelTokenizer(wrapper)
    control = ControlStrings.of(wrapper.backend_tokenizer, str(wrapper.chat_template))
    pieces = stress_pieces(wrapper, seed)

    def without_controls(text: str) -> str:
        while control is not None and control.pattern.search(text):
            text = control.pattern.sub("", text)  # which may join the rest into another
        return text

    rng = random.Random(seed)
    rendered = 0
    for _ in range(60):
        messages = random_conversation(rng, pieces, without_controls)
        tools = TOOLS if rng.random() < 0.5 else None
        for end, options in (("reply", {"add_generation_prompt": True}),
                             ("continue", {"continue_final_message": True}),
                             ("as_is", {})):
            cached = outcome(tokenizer.chat_prompt, messages, tools, end=end)
            assert cached == outcome(wrapper.apply_chat_template, messages,
                                     tools=tools, tokenize=True, **options), messages
            rendered += cached[0] == "ids"
    assert rendered > 100
