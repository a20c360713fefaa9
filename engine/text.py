"""Incremental text for one generation: detokenization and stop strings.

Each new token's text is what decoding the tokens so far adds to the text before it
(vLLM's incremental detokenization): with a fast tokenizer, `tokenizers`' own
`DecodeStream` does this in Rust (1.2 instead of 18 µs per token for the demo
tokenizer on the 2-core CPU machine, through mlx-lm's wrapper); otherwise a short
window of tokens is decoded with and without the new one. Either way the window starts
with the last few prompt tokens, so the first generated token keeps its leading space,
which decoding it alone would drop for many tokenizers, and a token that ends inside a
multi-byte character shows no text until the character is complete.

Text that could still turn out to be the start of a stop string is held back, so a stop
string is never emitted, even when it arrives split across several tokens; only that
text: the longest end of the text that begins a stop string (`StopPrefix`), not the
length of the longest stop string, which held a 200-character stop string's whole reply
back until it ended.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from engine.tokenizer import ModelTokenizer

# Prompt tokens decoded ahead of the first generated one, for context.
CONTEXT_TOKENS = 5


class WindowDecoder:
    """Decodes a window of recent tokens with and without the newest one."""

    def __init__(self, tokenizer: ModelTokenizer, context: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._tokens = list(context)
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def step(self, token: int) -> str:
        self._tokens.append(token)
        return self._new_text(final=False)

    def flush(self) -> str:
        """What is still undecoded, an incomplete character included (as U+FFFD)."""
        if self._read_offset == len(self._tokens):
            return ""  # every token shown (a readout, or a stop token last)
        return self._new_text(final=True)

    def _new_text(self, final: bool) -> str:
        decode = self._tokenizer.decode
        before = decode(self._tokens[self._prefix_offset:self._read_offset],
                        skip_special_tokens=True)
        after = decode(self._tokens[self._prefix_offset:], skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""  # nothing new yet, or an incomplete character
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return after[len(before):]


class StreamDecoder:
    """`tokenizers.decoders.DecodeStream`, with the tokens it has not shown yet kept, so
    `flush` can show them at the end."""

    def __init__(self, tokenizer: ModelTokenizer, context: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(list(context), skip_special_tokens=True)
        self._shown = list(context)  # the last tokens whose text was shown
        self._unshown: list[int] = []

    def step(self, token: int) -> str:
        text = self._stream.step(self._tokenizer.fast, token)
        self._unshown.append(token)
        if text is None:
            return ""
        self._shown = (self._shown + self._unshown)[-CONTEXT_TOKENS:]
        self._unshown = []
        return text

    def flush(self) -> str:
        """DecodeStream never shows an incomplete character; at the end it is shown as
        the window decoder shows it (U+FFFD)."""
        if not self._unshown:
            return ""
        window = WindowDecoder(self._tokenizer, self._shown)
        return "".join(window.step(token) for token in self._unshown) + window.flush()


class StopPrefix:
    """How long a start of `stop` the text fed so far ends with: Knuth-Morris-Pratt's
    automaton over the text, its failure links computed only as far as a match has
    reached, so a long stop string costs what the text does, not its own length."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.length = 0  # of the longest start of `stop` that ends the text
        # _links[k]: of the longest start of stop[:k] that is also its end, k < len(stop)
        self._links = [0, 0]

    def feed(self, text: str) -> int:
        stop, k = self.stop, self.length
        for char in text:
            if k == len(stop):
                k = self._link(k)
            while k and stop[k] != char:
                k = self._link(k)
            if stop[k] == char:
                k += 1
        self.length = k
        return k

    def _link(self, k: int) -> int:
        links, stop = self._links, self.stop
        while len(links) <= k:
            end = len(links) - 1  # links[end + 1], from stop[end] and links[end]
            j = links[end]
            while j and stop[end] != stop[j]:
                j = links[j]
            links.append(j + 1 if stop[end] == stop[j] else 0)
        return links[k]


def _whole_characters(tokenizer: ModelTokenizer, context: Sequence[int]) -> list[int]:
    """`context` less its last tokens while their text ends inside a character (a token
    prompt cut to a budget): seeded with such a context, DecodeStream showed the context's
    own text with the first token, and the window decoder lost the first character."""
    context = list(context)
    while context and tokenizer.decode(context, skip_special_tokens=True).endswith("\ufffd"):
        context.pop()
    return context


class TextStream:
    def __init__(self, tokenizer: ModelTokenizer, prompt: Sequence[int],
                 stop: Sequence[str], min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._context = prompt[-CONTEXT_TOKENS:]
        # Made at the first token: a readout (a classify list's 64 requests) has none,
        # and Rust's DecodeStream took ~40 us to make, on the server's event loop.
        self._decoder: StreamDecoder | WindowDecoder | None = None
        self._stop = tuple(s for s in stop if s)
        self._starts = [StopPrefix(s) for s in self._stop]
        self._held = ""  # decoded, not yet emitted (a stop string may start in it)
        self.matched_stop: str | None = None
        self.shown = 0  # characters returned so far
        # No stop string ends in the first `min_tokens` tokens' text, but one may begin
        # there and end after it (vLLM's stop checker), so that text is held back as any
        # other that may begin one; `_unsearched` is how much of `_held` it still is.
        self._min_tokens = min_tokens
        self._unsearched = 0

    def add(self, token: int) -> str:
        """Feed one token; return the text that is now safe to emit. When a stop string
        matches, `matched_stop` is set and the text before it is returned; nothing after."""
        if self.matched_stop is not None:
            return ""
        if self._decoder is None:
            tokenizer = self._tokenizer
            context = _whole_characters(tokenizer, self._context)
            self._decoder = (StreamDecoder(tokenizer, context) if tokenizer.fast is not None
                             else WindowDecoder(tokenizer, context))
        text = self._decoder.step(token)
        self._held += text
        if self._min_tokens:
            self._min_tokens -= 1
            self._unsearched = len(self._held)
        for start in self._starts:
            start.feed(text)
        return self._release(final=False)

    def finish(self) -> str:
        """Release everything still held back; nothing once a stop string matched (what
        follows a stop string is never shown)."""
        if self.matched_stop is not None:
            return ""
        if self._decoder is not None:
            self._held += self._decoder.flush()
        return self._release(final=True)

    @property
    def decoded(self) -> int:
        """Characters decoded so far, held ones included (until a stop string matches)."""
        return self.shown + len(self._held)

    def _release(self, final: bool) -> str:
        text = self._released(final)
        self.shown += len(text)
        self._unsearched = max(self._unsearched - len(text), 0)
        return text

    def _released(self, final: bool) -> str:
        if self._stop:
            # A match ends after the unsearched text, so it starts no earlier than
            # len(s) - 1 characters before that text's end.
            hits = [(i, s) for s in self._stop
                    if (i := self._held.find(s, max(self._unsearched - len(s) + 1, 0))) >= 0]
            if hits:
                index, self.matched_stop = min(hits)
                text, self._held = self._held[:index], ""
                return text
        keep = 0 if final else max((start.length for start in self._starts), default=0)
        cut = max(len(self._held) - keep, 0)
        text, self._held = self._held[:cut], self._held[cut:]
        return text
