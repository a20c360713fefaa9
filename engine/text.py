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
string is never emitted, even when it arrives split across several tokens.
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


class TextStream:
    def __init__(self, tokenizer: ModelTokenizer, prompt: Sequence[int],
                 stop: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._context = prompt[-CONTEXT_TOKENS:]
        # Made at the first token: a readout (a classify list's 64 requests) has none,
        # and Rust's DecodeStream took ~40 us to make, on the server's event loop.
        self._decoder: StreamDecoder | WindowDecoder | None = None
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._held = ""  # decoded, not yet emitted (a stop string may start in it)
        self.matched_stop: str | None = None

    def add(self, token: int) -> str:
        """Feed one token; return the text that is now safe to emit. When a stop string
        matches, `matched_stop` is set and the text before it is returned; nothing after."""
        if self.matched_stop is not None:
            return ""
        if self._decoder is None:
            tokenizer, context = self._tokenizer, self._context
            self._decoder = (StreamDecoder(tokenizer, context) if tokenizer.fast is not None
                             else WindowDecoder(tokenizer, context))
        self._held += self._decoder.step(token)
        return self._release(final=False)

    def finish(self) -> str:
        """Release everything still held back; nothing once a stop string matched (what
        follows a stop string is never shown)."""
        if self.matched_stop is not None:
            return ""
        if self._decoder is not None:
            self._held += self._decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._stop:
            hits = [(i, s) for s in self._stop if (i := self._held.find(s)) >= 0]
            if hits:
                index, self.matched_stop = min(hits)
                text, self._held = self._held[:index], ""
                return text
        keep = 0 if final else self._hold
        cut = max(len(self._held) - keep, 0)
        text, self._held = self._held[:cut], self._held[cut:]
        return text
