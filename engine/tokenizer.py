"""The model's tokenizer as its callers see it: encode/decode, the chat template, and the
markers the model writes around tool calls and reasoning, and its fill-in-the-middle tokens.

It wraps mlx-lm's `TokenizerWrapper` (which knows each model family's markers and tool
parser) behind the few operations the server needs, so the server never drives mlx-lm's
wrapper or a Hugging Face tokenizer itself. It imports nothing from MLX or mlx-lm.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import takewhile
from typing import Any, Literal

from jinja2 import TemplateError

from engine.api import TokenLogprob
from engine.control_tokens import BREAK, ControlStrings
from engine.fill_in_middle import FillInMiddleTokens, find_tokens
from engine.image_tokens import ImageTokens
from engine.token_cache import (
    NotCacheable,
    SegmentCache,
    component_steps,
    cut_tokens,
    special_ids,
)
from radix.prefix import common_prefix_length

log = logging.getLogger("radix_mlx.engine")

# Parses the text between a tool call's markers: (text, tools) -> one call or a list of
# them, each {"name": ..., "arguments": ...}; raises on text it cannot parse.
ToolParser = Callable[[str, Any], Any]

# Where a rendered chat ends: the assistant's turn opened for the reply, inside the final
# message (the reply continues it), or after the final message as the template ends it.
ChatEnd = Literal["reply", "continue", "as_is"]


@dataclass(frozen=True)
class ToolCallFormat:
    """How this model writes a tool call: `start` + body + `end`, the body read by `parse`;
    `separator` between parallel calls (Hermes/Qwen templates put a newline there)."""

    start: str
    end: str
    parse: ToolParser
    separator: str = "\n"


@dataclass(frozen=True)
class ThinkingMarkers:
    """The text (and token ids) around this model's reasoning."""

    start: str
    end: str
    start_tokens: tuple[int, ...]
    end_tokens: tuple[int, ...]


# Characters of a text too long to encode that are encoded to estimate its tokens.
SAMPLE_CHARS = 32_768


class TooManyTokens(Exception):
    """A text that holds more tokens than its request allows, known from its length alone,
    without encoding it: at least `least`, about `estimate` (from a sample encoded)."""

    def __init__(self, least: int, estimate: int) -> None:
        super().__init__(f"at least {least} tokens")
        self.least, self.estimate = least, estimate


class ModelTokenizer:
    def __init__(self, wrapper: Any, images: ImageTokens | None = None) -> None:
        """`wrapper`: mlx-lm's TokenizerWrapper for the model; `images`: how its prompts
        hold images (a vision model's)."""
        self._wrapper = wrapper
        self.images = images
        self.vocab_size: int = len(wrapper)
        """Token ids the tokenizer knows; an id at or past it is not one of the model's."""
        self.eos_token_ids: frozenset[int] = frozenset(wrapper.eos_token_ids)
        self.has_chat_template: bool = bool(wrapper.has_chat_template)
        # The template's text (several templates by name: all of them), for what the
        # server asks of it.
        self.chat_template_text: str = str(getattr(wrapper, "chat_template", None) or "")
        self.tool_calls: ToolCallFormat | None = None
        if wrapper.has_tool_calling:
            self.tool_calls = ToolCallFormat(wrapper.tool_call_start, wrapper.tool_call_end,
                                             wrapper.tool_parser)
        self.thinking: ThinkingMarkers | None = None
        if wrapper.has_thinking:
            self.thinking = ThinkingMarkers(wrapper.think_start, wrapper.think_end,
                                            tuple(wrapper.think_start_tokens),
                                            tuple(wrapper.think_end_tokens))

        # The Rust tokenizer under a Hugging Face "fast" tokenizer; None for others.
        self.fast: Any = getattr(wrapper, "backend_tokenizer", None)
        self._piece_bytes = _piece_reader(self.fast)
        # Prompt text encoded in cached segments, when the tokenizer allows it exactly.
        self._segments = _segment_cache(getattr(wrapper.encode, "__self__", None))
        self._special_ids = special_ids(self.fast) if self._segments is not None else None
        self.trailing_specials: int = 0 if self.fast is None else trailing_specials(self.fast)
        # The control strings a message's text must not become tokens through.
        self._control = (None if self.fast is None
                         else ControlStrings.of(self.fast, self.chat_template_text))
        self._token_pieces: dict[int, tuple[str, bytes]] = {}  # text and bytes, by id

    def token_logprob(self, token: int, logprob: float) -> TokenLogprob:
        """A logprob entry: the token's own text and bytes (`token_piece`)."""
        text, data = self.token_piece(token)
        return TokenLogprob(token, text, logprob, data)

    def token_piece(self, token: int) -> tuple[str, bytes]:
        """Token `token`'s own text and bytes, looked up once per token id (a readout or
        a top-k list asks for them per row and per alternative, and decoding each took
        ~20 us of the engine's thread)."""
        piece = self._token_pieces.get(token)
        if piece is None:
            piece = self._token_pieces[token] = (self.decode([token]), self._token_bytes(token))
        return piece

    def _token_bytes(self, token: int) -> bytes:
        """The bytes token `token` stands for: for a token holding part of a UTF-8
        character, that part (decoding it alone gives U+FFFD instead)."""
        piece = self.fast.id_to_token(token) if self._piece_bytes is not None else None
        if piece is not None:
            try:
                return self._piece_bytes(piece)
            except KeyError:  # an added token (e.g. <|im_end|>) is stored as its text
                pass
        return self.decode([token]).encode("utf-8")

    @cached_property
    def fill_in_middle(self) -> FillInMiddleTokens | None:
        """The model's fill-in-the-middle tokens; None when it was not trained for it.
        Looked up by name in the Rust tokenizer where there is one: the whole vocabulary as
        a dict took 23 ms for SmolLM2's 49k tokens, at every load of a model."""
        if self.fast is not None:
            return find_tokens(self.fast.token_to_id)
        return find_tokens(self.vocabulary().get)

    @cached_property
    def prompt_head(self) -> tuple[int, ...]:
        """What encoding a whole prompt puts before its text (Llama's BOS)."""
        text, whole = self.encode("a", special_tokens=False), self.encode("a")
        return tuple(whole[:whole.index(text[0])]) if text and text[0] in whole else ()

    def vocabulary(self) -> dict[str, int]:
        """Each vocabulary piece's id, added tokens included."""
        return self._wrapper.get_vocab()

    def check_length(self, text: str, most_tokens: int | None) -> None:
        """Raise `TooManyTokens` if `text` holds more than `most_tokens` tokens by its length
        alone: a 4 MB prompt was encoded whole, 16 s of a busy core, only to be told it
        did not fit the context window."""
        # A token stands for a character or more: a text no longer than `most_tokens`
        # fits, and most prompts need not look up the bound at all.
        if most_tokens is None or len(text) <= most_tokens or self.most_chars_a_token is None:
            return
        least = (len(text) - text.count(BREAK)) // self.most_chars_a_token
        if least > most_tokens:
            raise TooManyTokens(least, max(least, self._estimated_tokens(text)))

    def _estimated_tokens(self, text: str) -> int:
        """`text`'s tokens, from its first and last `SAMPLE_CHARS` characters encoded."""
        half = SAMPLE_CHARS // 2
        sample = text if len(text) <= SAMPLE_CHARS else text[:half] + text[-half:]
        return round(len(self.encode(sample, special_tokens=False)) * len(text) / len(sample))

    @cached_property
    def most_chars_a_token(self) -> int | None:
        """The most characters of text one token stands for, where a tokenizer's pieces
        bound it: None but for byte-level BPE (each piece a run of the text's bytes, so of
        at most as many characters) without a normalizer or pre-tokenizer that drops
        characters; NFC composes at most three characters into one."""
        if self.fast is None or not _byte_level(self.fast):
            return None
        normalizers = {step["type"] for step in component_steps(self.fast.normalizer)}
        if not normalizers <= {"NFC"} or not all(
                step["type"] in ("ByteLevel", "Digits")
                or (step["type"] == "Split" and step.get("behavior") != "Removed")
                for step in component_steps(self.fast.pre_tokenizer)):
            return None
        longest = max(map(len, map(self._token_bytes, self.fast.get_vocab().values())),
                      default=1)
        return longest * (3 if normalizers else 1)

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `special_tokens` adds what the tokenizer adds to a whole
        prompt (e.g. BOS)."""
        if self._segments is not None and not special_tokens:
            return self._segments.encode(text)
        if self._segments is not None and self._special_ids is not None:
            before, after = self._special_ids
            return [*before, *self._segments.encode(text), *after]
        return list(self._wrapper.encode(text, add_special_tokens=special_tokens))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text: where the segment cache vouches that this is a plain
        Hugging Face fast tokenizer (its encode is the Rust one's), all in one Rust call
        that leaves the GIL; a list of new texts gains nothing from the cache."""
        if self._segments is not None:
            return [encoding.ids for encoding in self.fast.encode_batch(list(texts))]
        return [self.encode(text) for text in texts]

    def decode(self, tokens: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._wrapper.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def chat_prompt(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    variables: dict[str, Any] | None = None,
                    end: ChatEnd = "reply", image_counts: Sequence[int] = (),
                    most_tokens: int | None = None) -> list[int]:
        """The prompt token ids for `messages`, through the model's chat template, ending
        where the assistant's reply starts (`end` "reply"), inside the final message so
        that the reply continues it ("continue": transformers' `continue_final_message`,
        which cuts the rendering right after that message's text), or after the final
        message ("as_is"). `variables` are extra template variables; `image_counts`: the
        tokens of each image the messages place, in order (`ImageTokens.counts`).

        Raises jinja2's TemplateError or ValueError when the template rejects the
        messages (say, roles that do not alternate), `TooManyTokens` when the rendered
        text is too long to hold at most `most_tokens` (`check_length`)."""
        return self._render(messages, tools, variables, image_counts, most_tokens,
                            add_generation_prompt=end == "reply",
                            continue_final_message=end == "continue")

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                variables: dict[str, Any] | None, image_counts: Sequence[int],
                most_tokens: int | None = None, **options: bool) -> list[int]:
        """The template's rendering as token ids. tokenize=True renders the text and
        encodes it without special tokens; that is done here when the text is encoded in
        cached segments, a vision model's image markers (`image_tokens.MARKER`) are to
        become its image tokens first (as its processor expands its placeholders), or a
        message the model did not write holds a control string, read as text
        (engine/control_tokens.py), and where the text is checked against `most_tokens`
        before it is encoded."""
        read = messages if self._control is None else self._control.as_text(messages)
        if self.images is None and self._segments is None and read is messages:
            return list(self._wrapper.apply_chat_template(
                messages, **(variables or {}), tools=tools, tokenize=True, **options))
        text = self._wrapper.apply_chat_template(
            read, **(variables or {}), tools=tools, tokenize=False, **options)
        self.check_length(text, most_tokens)
        if self.images is not None:
            text = self.images.expand(text, image_counts)
        if read is not messages and (ids := self._control.encode(text)) is not None:
            return ids
        return self.encode(text, special_tokens=False)

    def shared_lengths(self, prompt: list[int], heads: Sequence[list[dict[str, Any]]],
                       tools: list[dict[str, Any]] | None = None,
                       variables: dict[str, Any] | None = None,
                       image_counts: Sequence[int] = ()) -> tuple[int, ...]:
        """How many tokens `prompt` (a `chat_prompt` with `tools`, `variables` and
        `image_counts`) shares with the rendering of each of `heads` (message lists, no
        reply started): where in it the messages of a head end, when the head is the
        prompt's first messages. Zeros and heads the template rejects (some want a user
        message) are left out."""
        lengths = set()
        for head in heads:
            try:
                rendered = self._render(head, tools, variables, image_counts,
                                        add_generation_prompt=False)
            except (TemplateError, ValueError):
                continue
            if shared := common_prefix_length(rendered, prompt):
                lengths.add(shared)
        return tuple(sorted(lengths))


def trailing_specials(backend: Any) -> int:
    """How many special tokens the Rust tokenizer `backend` puts after a text's own (BERT's
    [SEP], the EOS an embedding model's tokenizer appends; none after Llama's BOS): a text
    cut short keeps them at its end, as Hugging Face's truncation does. Padding its file
    may set is not counted."""
    encoding = backend.post_process(backend.encode("a", add_special_tokens=False))
    specials = [special for special, attended
                in zip(encoding.special_tokens_mask, encoding.attention_mask) if attended]
    return sum(1 for _ in takewhile(bool, reversed(specials)))


def _segment_cache(tokenizer: Any) -> SegmentCache | None:
    """The segment cache of the Hugging Face `tokenizer` (the one mlx-lm's wrapper
    forwards `encode` to), or None when its encoding cannot be cut exactly."""
    try:
        cuts = cut_tokens(tokenizer)
    except NotCacheable as reason:
        log.debug("prompt tokenization not cached: %s", reason)
        return None
    log.debug("prompt tokenization cached in segments ending with %s", " ".join(cuts))
    return SegmentCache(lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"],
                        cuts)


def _piece_reader(fast: Any) -> Callable[[str], bytes] | None:
    """How a vocabulary piece maps to bytes, for the two decoders that store bytes in
    pieces: byte-level BPE (GPT-2, Llama 3, Qwen) and SentencePiece with byte fallback."""
    if fast is None:
        return None
    if _byte_level(fast):
        byte_of = _gpt2_byte_decoder()
        return lambda piece: bytes(byte_of[char] for char in piece)
    if any(step["type"] == "ByteFallback" for step in component_steps(fast.decoder)):
        return _sentencepiece_bytes
    return None


def _byte_level(fast: Any) -> bool:
    """Does the Rust tokenizer `fast` decode byte-level BPE (GPT-2, Llama 3, Qwen)?"""
    return [step["type"] for step in component_steps(fast.decoder)] == ["ByteLevel"]


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _sentencepiece_bytes(piece: str) -> bytes:
    if match := _BYTE_PIECE.fullmatch(piece):
        return bytes([int(match[1], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: each byte is stored as a printable
    character (printable ASCII and Latin-1 as themselves, the rest from U+0100 up)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = [byte for byte in range(256) if byte not in kept]
    return {**{chr(byte): byte for byte in kept},
            **{chr(256 + i): byte for i, byte in enumerate(shifted)}}
