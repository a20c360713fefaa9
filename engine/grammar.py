"""Constrained decoding: one llguidance matcher per constrained sequence, and its masks.

Why llguidance, measured on SmolLM2's 49152-token vocabulary (2-core CPU): compiling a
JSON Schema took 0.6-1.9 ms and a token mask took 8 us (median; 0.15-1.6 ms for the first
masks of a grammar, while its lexer warms up). outlines-core compiled the same schemas
into its token index in 41-302 ms, and "any JSON object" in 6 s (as a regex, so nesting is
bounded), for masks of 1-24 us; it has no grammar for a tool-call wrapper around a schema.
xgrammar needs torch. llguidance is also what llama.cpp, vLLM and SGLang use, and its
Lark grammars embed JSON Schemas (`%json {...}`), which the tool-call grammars need.

Masks are computed on the CPU while the device runs the forward pass that they will mask
(see `Generator._constrain`), and applied with plain MLX ops (llguidance's own MLX helper
is a Metal kernel, which the CPU and CUDA backends do not run). A key an open object of
JSON repeats is taken out of the mask here too, since no grammar can say it (json_keys.py).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from engine.api import Constraint
from engine.json_keys import (
    IN_KEY,
    JsonKeys,
    KeyTokens,
    continuing,
    repeating_after,
    toward_key,
)
from engine.tokenizer import ModelTokenizer

# Compiled grammars kept for reuse (a compile is ~1 ms, a copy of one ~10-30 us; a schema
# of thousands of properties takes seconds), and those that failed, by their error; at
# most this many, whose texts together are at most GRAMMAR_CACHE_CHARS long: a compiled
# grammar takes ~100 bytes a character of its text (25 schemas of ~300 kB each held
# 730 MB), where an agent's usual schemas are a few kB.
GRAMMAR_CACHE_SIZE = 64
GRAMMAR_CACHE_CHARS = 2 * 2**20
# How many tokens ahead a step looks for a way to its object's next key that repeats none
# (`GrammarState._cornered`): the separators and a key as long as the longest written,
# where a grammar of fixed separators needs three tokens or so before the key.
LOOKAHEAD_TOKENS = 64


# llguidance's reasons for a matcher that allows no next token, as a client reads them.
STOP_REASONS = {"NoExtension": "nothing the grammar allows can follow the output so far",
                "NoExtensionBias": "nothing the grammar allows can follow the output so far"}


def matcher_error(matcher: LLMatcher) -> str | None:
    """The matcher's error without the parser state and grammar that llguidance appends
    (kilobytes of both, which went into the client's 400 as they were)."""
    error = matcher.get_error()
    if not error:
        return None
    first = error.split("\n", 1)[0].strip()
    return STOP_REASONS.get(first, first)


class ConstraintFailed(Exception):
    """A constraint cannot be enforced for this request: the grammar does not compile
    for this tokenizer, or the matcher failed while generating."""


class MarkerGuard:
    """Keeps a plain-text marker from ending inside a token: the tokens in which it would
    end before their last byte, after each proper prefix of it that the output may end
    with. SmolLM2 writes `<tool_call` then `></`; a grammar waiting for `<tool_call>`
    would never see it end, and what follows would go unmasked."""

    def __init__(self, marker: bytes, token_bytes: Sequence[bytes], words: int) -> None:
        self.marker = marker
        banned: dict[int, list[int]] = {}  # by the prefix's length (0: none needed)
        last = marker[-1:]
        for token, data in enumerate(token_bytes):
            end = data.find(last)
            while 0 <= end < len(data) - 1:  # the marker would end at data[:end + 1]
                head = data[:end + 1]
                if len(head) >= len(marker):
                    if head.endswith(marker):
                        banned.setdefault(0, []).append(token)
                elif marker.endswith(head):
                    banned.setdefault(len(marker) - len(head), []).append(token)
                end = data.find(last, end + 1)
        self._allowed = {prefix: _without(tokens, words) for prefix, tokens in banned.items()}

    def allowed(self, tail: bytes) -> np.ndarray | None:
        """The mask of a row whose output ends with `tail` (at least the marker's length
        less one byte, where it has as much), None where no token is banned."""
        rows = [allowed for prefix, allowed in self._allowed.items()
                if prefix == 0 or tail.endswith(self.marker[:prefix])]
        return np.bitwise_and.reduce(rows) if rows else None


def _without(tokens: list[int], words: int) -> np.ndarray:
    mask = np.full(words, -1, dtype=np.int32)
    ids = np.array(tokens, dtype=np.uint32)
    np.bitwise_and.at(mask.view(np.uint32), ids >> 5, ~(np.uint32(1) << (ids & 31)))
    return mask


class GrammarState:
    """The constraint of one sequence: free text until the marker (if any), then the
    grammar's matcher, which must accept every token from there on, and no token that
    repeats a key of the JSON it writes."""

    def __init__(self, compiled: LLMatcher, marker: tuple[int, ...], words: int,
                 key_tokens: KeyTokens, guard: MarkerGuard | None = None,
                 look_ahead: bool = False, json_text: bool = True) -> None:
        """`marker`: the tokens after which the grammar starts (none: at once). A model
        may write a marker of plain text in other tokens than its encoding's (`<tool`
        `_call>`): the output's text ending with it starts the grammar too, and `guard`
        keeps it from ending inside a token, where that would not be seen. `look_ahead`:
        the grammar's objects may run out of keys (`Constraint.bounded_keys`), so each
        step looks ahead for a way to a key not written (`_cornered`). `json_text` False:
        the text is no JSON (`Constraint.json_text`), so no key is tracked in it."""
        self._compiled = compiled
        self.words = words  # 32-bit words in one row of a token mask
        self._marker = marker
        self._guard = guard
        self._key_tokens = key_tokens
        self._keys = JsonKeys() if json_text else None
        self._look_ahead = look_ahead
        self._recent: list[int] = []
        self._tail = b""  # the output's last bytes, as long as the guard's marker
        self.matcher: LLMatcher | None = None if marker else compiled.deep_copy()
        self.error: str | None = None
        self._taken = 0  # tokens taken in (`accept`), those before the marker too
        self._complete_at: int | None = None  # `_taken` when the grammar became complete

    @property
    def waiting(self) -> bool:
        """Before its marker: a token taken in now may start the grammar, but can neither
        complete it nor break it."""
        return self.matcher is None

    @property
    def constraining(self) -> bool:
        """The next token is masked: by the grammar, or while waiting for the marker,
        where a token would end it inside itself."""
        return self.error is None and (self.matcher is not None or self._guarded() is not None)

    def _guarded(self) -> np.ndarray | None:
        if self.matcher is not None or self._guard is None:
            return None
        return self._guard.allowed(self._tail)

    def fill(self, row: np.ndarray) -> None:
        """Write the next token's mask into `row` (int32 words, all set)."""
        if self.matcher is not None:
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, self.words * 4)
        elif (allowed := self._guarded()) is not None:
            row[:] = allowed

    def complete_after(self, tokens: int) -> bool:
        """Whether the grammar was complete, allowing no further token (but EOS), once it
        had taken in the output's first `tokens` tokens. A speculative step takes in a
        whole accepted draft before its tokens reach the request one by one: the state
        after the last of them would have ended the request at the first."""
        return self._complete_at is not None and tokens >= self._complete_at

    def accept(self, token: int) -> None:
        self._taken += 1
        if self.error is not None:
            return
        if self.matcher is None:
            self._recent = (self._recent + [token])[-len(self._marker):]
            guard = self._guard
            if guard is not None:
                self._tail = (self._tail + self._key_tokens.token_bytes[token])[
                    -len(guard.marker):]
            if tuple(self._recent) == self._marker or (
                    guard is not None and self._tail == guard.marker):
                self.matcher = self._compiled.deep_copy()
            return
        if not self.matcher.consume_token(token):
            self.error = matcher_error(self.matcher) or f"token {token} is not allowed here"
        elif self._complete_at is None and self.matcher.is_stopped():
            self._complete_at = self._taken
        if self._keys is not None:
            self._keys.feed(self._key_tokens.token_bytes[token])

    def fork(self) -> GrammarState:
        """A copy to advance over draft tokens (speculative decoding) while this one stays
        where the output is: the accepted part of the draft is then taken in here as any
        token is. A copy rather than llguidance's rollback, since the key tracking has
        none."""
        fork = copy.copy(self)
        fork._keys = copy.deepcopy(self._keys)
        fork._recent = list(self._recent)
        if self.matcher is not None:
            fork.matcher = self.matcher.deep_copy()
        return fork

    def check(self, mask: np.ndarray) -> None:
        """Take the tokens that would repeat a key out of `mask`, this row's as the
        matcher computed it, and those after which the grammar lets the key end only so
        (`_cornered`); record an error the matcher entered meanwhile, or the dead end of a
        mask left empty (an object whose possible keys are all written)."""
        if self.matcher is None:  # waiting for the marker: nothing of the grammar's yet
            return
        if self.error is None and self.matcher.is_error():
            self.error = matcher_error(self.matcher)
        if self.error is not None or self._keys is None:
            return
        removed = self._keys.repeating(self._key_tokens)
        _clear(mask, removed)
        if self._look_ahead and (cornered := self._cornered(mask)):
            _clear(mask, cornered)
            removed += cornered
        if removed and not mask.any():
            self.error = "every token the grammar allows here repeats a key"

    def _cornered(self, mask: np.ndarray) -> list[int]:
        """The tokens `mask` allows after which every way the grammar allows, up to the
        next key of the innermost object, ends it as a key the object has: under
        `^(a|b)$`, `b` after `{"b": 0, "`, and the comma after `{"a": 0, "b": 1`. Found
        by taking each in and looking at the masks that follow, while the output stays
        on its way to that key and the key on a written one's bytes (`toward_key`)."""
        position = self._keys.position()
        if position is None:
            return []
        phase, raw, keys = position
        token_bytes = self._key_tokens.token_bytes
        way_out: dict[bytes, bool] = {}  # by the bytes written since this position

        def candidates(phase: int, raw: bytes, mask: np.ndarray) -> np.ndarray:
            """The tokens `mask` allows that may not leave the way to the key, the
            longest first (they get further)."""
            if phase == IN_KEY:
                ids = np.array(sorted(
                    continuing(self._key_tokens, raw, keys).union(
                        repeating_after(self._key_tokens, raw, False, keys)),
                    key=lambda token: -len(token_bytes[token])), dtype=np.uint32)
            else:
                ids = self._key_tokens.separating  # longest first already
            return ids[mask.view(np.uint32)[ids >> 5] >> (ids & 31) & 1 == 1]

        def leaves(written: bytes, phase: int, raw: bytes, token: int, depth: int) -> bool:
            after = toward_key(phase, raw, token_bytes[token], keys)
            if isinstance(after, bool):
                return after
            written += token_bytes[token]
            if written not in way_out:
                if depth == LOOKAHEAD_TOKENS or not self.matcher.consume_token(token):
                    return True  # not seen to the end: a way out is assumed
                mask = np.full(self.words, -1, dtype=np.int32)
                self.fill(mask)
                near = candidates(*after, mask)
                others = mask.copy()
                _clear(others, near)
                way_out[written] = bool(others.any()) or any(
                    leaves(written, *after, int(following), depth + 1) for following in near)
                self.matcher.rollback(1)
            return way_out[written]

        return [int(token) for token in candidates(phase, raw, mask)
                if not leaves(b"", phase, raw, int(token), 0)]


def _clear(mask: np.ndarray, tokens: Sequence[int] | np.ndarray) -> None:
    """Take `tokens` out of `mask`."""
    if not len(tokens):
        return
    ids = np.asarray(tokens, dtype=np.uint32)
    np.bitwise_and.at(mask.view(np.uint32), ids >> 5, ~(np.uint32(1) << (ids & 31)))


class Grammars:
    """One model's view for llguidance: its tokenizer, and compiled grammars by text.
    `compile` may run on another thread than `state` (llguidance lets go of the GIL)."""

    def __init__(self, tokenizer: ModelTokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lltokenizer: LLTokenizer | None = None
        self._key_tokens: KeyTokens | None = None
        self._compiled: OrderedDict[str, LLMatcher | str] = OrderedDict()
        self._chars = 0  # the cached grammars' text
        self._markers: dict[str, tuple[int, ...]] = {}
        self._guards: dict[str, MarkerGuard] = {}
        self._lock = threading.Lock()  # the cache, and llguidance's tokenizer made once

    def state(self, constraint: Constraint, generated: Iterable[int] = ()) -> GrammarState:
        """A fresh state for `constraint`, advanced over the tokens already generated
        (a request admitted again after a failed step)."""
        marker = self._marker(constraint.after) if constraint.after else ()
        state = GrammarState(self._compile(constraint.grammar), marker,
                             words=(self._vocab_size + 31) // 32,
                             key_tokens=self._vocabulary_key_tokens(),
                             guard=self._guard(constraint.after) if constraint.after else None,
                             look_ahead=constraint.bounded_keys,
                             json_text=constraint.json_text)
        for token in generated:
            state.accept(token)
        if state.error is not None:
            raise ConstraintFailed(state.error)
        return state

    def compiled(self, grammar: str) -> bool:
        """Whether `grammar` was compiled (or failed to), so that `state` costs no compile."""
        with self._lock:
            return grammar in self._compiled

    def compile(self, grammar: str) -> None:
        """Compile `grammar` for a later `state`; a failure is kept for it to raise."""
        try:
            self._compile(grammar)
        except ConstraintFailed:
            pass

    def _compile(self, grammar: str) -> LLMatcher:
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
        if compiled is None:
            try:
                matcher = LLMatcher(self.prepare(), grammar, log_level=0)
                compiled = (f"invalid grammar: {matcher.get_error()}" if matcher.is_error()
                            else matcher)
            except ConstraintFailed as error:  # no tokenizer llguidance can read
                compiled = str(error)
            with self._lock:
                if grammar not in self._compiled:  # compiled on two threads at once
                    self._chars += len(grammar)
                self._compiled[grammar] = compiled
                while len(self._compiled) > 1 and (len(self._compiled) > GRAMMAR_CACHE_SIZE
                                                   or self._chars > GRAMMAR_CACHE_CHARS):
                    self._chars -= len(self._compiled.popitem(last=False)[0])
        if isinstance(compiled, str):
            raise ConstraintFailed(compiled)
        return compiled

    def _vocabulary_key_tokens(self) -> KeyTokens:
        if self._key_tokens is None:  # ~15 ms for a 49k vocabulary
            tokenizer = self.prepare()
            self._key_tokens = KeyTokens([
                b"" if tokenizer.is_special_token(token) else tokenizer.decode_bytes([token])
                for token in range(self._vocab_size)])
        return self._key_tokens

    def _guard(self, text: str) -> MarkerGuard:
        if text not in self._guards:  # ~10 ms for a 49k vocabulary
            self._guards[text] = MarkerGuard(text.encode(), self._vocabulary_key_tokens().token_bytes,
                                             (self._vocab_size + 31) // 32)
        return self._guards[text]

    def _marker(self, text: str) -> tuple[int, ...]:
        if text not in self._markers:
            self._markers[text] = tuple(self._tokenizer.encode(text, special_tokens=False))
        return self._markers[text]

    def prepare(self) -> LLTokenizer:
        """llguidance's copy of the tokenizer, built on first use (~0.25 s for a 49k
        vocabulary): what llguidance.hf does, without its check for transformers' class,
        which transformers 5 renamed."""
        with self._lock:
            return self._prepared()

    def _prepared(self) -> LLTokenizer:
        if self._lltokenizer is None:
            backend = self._tokenizer.fast
            if backend is None:
                raise ConstraintFailed("constrained decoding needs a fast (tokenizers "
                                       "library) tokenizer, and this model has none")
            backend = copy.copy(backend)
            backend.no_padding()
            backend.no_truncation()
            self._lltokenizer = LLTokenizer(backend.to_str(), n_vocab=self._vocab_size,
                                            eos_token=sorted(self._tokenizer.eos_token_ids))
        return self._lltokenizer


def apply_masks(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """Logits with every token a row's mask forbids set to -inf, in plain MLX ops
    (compiled into one kernel: unfused, they cost ~0.3 ms a step on an H100)."""
    return _masked(logits, mx.array(bitmask))


@mx.compile
def _masked(logits: mx.array, bitmask: mx.array) -> mx.array:
    bits = (bitmask[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :logits.shape[-1]].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-float("inf"), logits.dtype))


def draft_masks(state: GrammarState, mask: np.ndarray, draft: list[int]) -> np.ndarray:
    """The masks of a constrained row's verify positions, given `mask`, its first one (the
    state has taken in every token before the draft): one row per draft token it allows
    before the first it forbids, then the mask after that token; the draft is kept up to
    the rows returned, less one."""
    rows = [mask]
    fork = state.fork()
    for token in draft:
        if not rows[-1][token >> 5] >> (token & 31) & 1:
            break
        following = masks([fork], [token])
        if fork.error is not None:
            break
        rows.append(following[0] if following is not None else np.full_like(mask, -1))
    return np.stack(rows)


def masks(states: Sequence[GrammarState | None], tokens: Sequence[int] | None
          ) -> np.ndarray | None:
    """Let each row's state accept the row's new token (`tokens`; None when the rows have
    sampled nothing yet), then compute every row's mask for its next token: (rows, words)
    int32 bits, all set for a free row. None when no row is constrained."""
    if tokens is not None:
        for state, token in zip(states, tokens):
            if state is not None:
                state.accept(token)
    rows = [i for i, s in enumerate(states) if s is not None and s.constraining]
    if not rows:
        return None
    bitmask = np.full((len(states), states[rows[0]].words), -1, dtype=np.int32)
    # One after another: ~10 us a row on an H100's host for a JSON Schema over a 49k
    # vocabulary; llguidance's thread pool took longer for 16 rows (0.24 ms vs 0.17 ms).
    for i in rows:
        states[i].fill(bitmask[i])
    for i in rows:
        states[i].check(bitmask[i])
        if states[i].error is not None:
            bitmask[i] = -1  # the row fails at this token; keep its sampling finite
    return bitmask

