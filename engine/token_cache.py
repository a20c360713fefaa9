"""The token ids of prompt text the server has seen, cached in segments, and exactly the
ids the tokenizer gives the whole text.

Why it is exact. A Hugging Face tokenizer (the Rust `tokenizers` library) first cuts the
text at its added tokens: those not normalized are found on the raw text, leftmost and
longest first, each becoming one token (AddedVocabulary::extract_and_normalize). Then it
normalizes, pre-tokenizes and runs the model on each remaining piece by itself, and
concatenates. So if the text is cut right after an occurrence of an added token S that the
tokenizer always matches as S, the pieces of the whole are the pieces of the two halves, and

    encode(A + B) == encode(A) + encode(B)

as long as no step looks past its own piece. `cut_tokens` checks, once per tokenizer and
from its own configuration, that this holds for the tokens it returns:

- S is matched on the raw text (normalized=False) as itself: no lstrip, rstrip (it would
  take the spaces after the cut into S) or single_word (it looks at the character after S);
- every occurrence of S is a match of S: no added token contains S or ends with a start of
  S (S included, so occurrences never overlap), and special tokens are matched
  (transformers' split_special_tokens is off);
- a single_word added token right after the cut sees the start of text in B alone but S's
  last character in A + B, so with such tokens S must end with a non-word character;
- the normalizer, pre-tokenizer and model are of the types read in `tokenizers`' source to
  see only their piece's text (Metaspace with prepend_scheme "first" is not: it prepends
  "▁" only to the piece at offset 0 of the whole text), the model has no randomness (BPE
  dropout), and the post-processor adds nothing when special tokens are not added;
- transformers' encode, __call__ and chat-template rendering are the library's own (a
  subclass that rewrote the text before encoding it would break the argument).

Segment ids are cached under the segment's text in a dict, which compares the whole strings
on a hash match: a collision cannot return another text's ids.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# Bound of the cache, in characters of cached text. The ids take about one byte per
# character on top (4-byte ids, ~4 characters a token).
DEFAULT_MAX_CHARS = 16_000_000
# Segments are grouped up to at least this many characters before they are cached: fewer,
# larger entries; the short rest of a text is encoded without being cached.
DEFAULT_MIN_CHARS = 256

# The component types whose steps see only the piece they are given (read in tokenizers
# 0.23's source: none of them reads the piece's offset in the whole text or its index).
_PIECE_NORMALIZERS = frozenset({
    "BertNormalizer", "ByteLevel", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "Nmt",
    "Precompiled", "Prepend", "Replace", "Strip", "StripAccents"})
_PIECE_PRE_TOKENIZERS = frozenset({
    "BertPreTokenizer", "ByteLevel", "CharDelimiterSplit", "Digits", "FixedLength",
    "Metaspace", "Punctuation", "Split", "UnicodeScripts", "Whitespace", "WhitespaceSplit"})
_PIECE_MODELS = frozenset({"BPE", "Unigram", "WordLevel", "WordPiece"})
# Post-processors that only add special tokens, and only when asked to add them.
_SPECIAL_ONLY_PROCESSORS = frozenset({
    "BertProcessing", "ByteLevel", "RobertaProcessing", "TemplateProcessing"})
# transformers' methods between a caller's text and the Rust tokenizer.
_ENCODE_PATH = ("__call__", "encode", "_encode_plus", "apply_chat_template")


class NotCacheable(ValueError):
    """The tokenizer's encoding cannot be split at its added tokens (the reason)."""


def cut_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The special tokens written by `tokenizer`'s chat template after which its text can
    be cut without changing its ids (see the module's docstring). `tokenizer` is a
    transformers tokenizer; raises NotCacheable for one that does not qualify."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise NotCacheable("no Rust tokenizer")
    _check_encode_path(tokenizer)
    _check_pipeline(backend)
    if tokenizer.split_special_tokens:
        raise NotCacheable("split_special_tokens is on")
    raw = [token for token in backend.get_added_tokens_decoder().values()
           if not token.normalized]
    template = _template_text(tokenizer.chat_template)
    written = [token for token in raw if token.special and token.content
               and token.content in template]
    if not written:
        raise NotCacheable("its chat template writes no special token matched on raw text")
    single_word = any(token.single_word for token in raw)
    refused = {token.content: _why_not_cut(token, raw, single_word) for token in written}
    cuts = tuple(sorted(content for content, why in refused.items() if why is None))
    if not cuts:
        raise NotCacheable("; ".join(f"{content} {why}" for content, why in refused.items()))
    return cuts


def special_ids(backend: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ids that adding special tokens puts before and after a text's own (BOS, say),
    read from the Rust tokenizer's post-processor; None when it does more than that."""
    if backend.post_processor is None:
        return (), ()
    state = json.loads(backend.post_processor.__getstate__())
    steps = state.get("processors", []) if state["type"] == "Sequence" else [state]
    if any(step["type"] not in ("ByteLevel", "TemplateProcessing") for step in steps):
        return None
    templates = [step for step in steps if step["type"] == "TemplateProcessing"]
    if not templates:
        return (), ()
    if len(templates) > 1:
        return None
    pieces, specials = templates[0]["single"], templates[0]["special_tokens"]
    text_at = [i for i, piece in enumerate(pieces) if "Sequence" in piece]
    if len(text_at) != 1 or pieces[text_at[0]]["Sequence"]["id"] != "A":
        return None

    def ids(part: list[dict[str, Any]]) -> tuple[int, ...]:
        return tuple(i for piece in part for i in specials[piece["SpecialToken"]["id"]]["ids"])

    return ids(pieces[:text_at[0]]), ids(pieces[text_at[0] + 1:])


class SegmentCache:
    """Token ids of texts, cached per segment: each segment ends right after a cut token
    (or at the end of the text), and consecutive segments are grouped until a group has
    `min_chars` characters. A text's ids are its groups' ids, concatenated. The cache is
    an LRU bounded by `max_chars` characters of cached text. Safe to call from several
    threads: the dict is touched under a lock, the encoding is done outside it."""

    def __init__(self, encode_batch: Callable[[list[str]], Sequence[Sequence[int]]],
                 cuts: Sequence[str], max_chars: int = DEFAULT_MAX_CHARS,
                 min_chars: int = DEFAULT_MIN_CHARS) -> None:
        """`encode_batch`: the ids of each text, as the tokenizer encodes it alone, without
        special tokens; `cuts`: tokens after which a text can be cut (`cut_tokens`)."""
        self._encode_batch = encode_batch
        # The cut tokens never overlap (cut_tokens checks it), so any order finds them all.
        self._cut = re.compile("|".join(re.escape(cut) for cut in cuts))
        self.max_chars = max_chars
        self._min_chars = min_chars
        self._entries: OrderedDict[str, array] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    @property
    def chars(self) -> int:
        """Characters of text cached now (at most `max_chars`)."""
        return self._chars

    def encode(self, text: str) -> list[int]:
        groups = list(self._groups(text))
        for group in groups:
            hash(group)  # computed once and kept by the string: not under the lock
        with self._lock:
            found = [self._get(group) for group in groups]
        missing = [group for group, ids in zip(groups, found, strict=True) if ids is None]
        encoded = iter(self._encode_batch(missing) if missing else ())
        tokens: list[int] = []
        for group, ids in zip(groups, found, strict=True):
            if ids is None:
                ids = array("I", next(encoded))
                if len(group) >= self._min_chars:
                    self._put(group, ids)
            tokens.extend(ids)
        return tokens

    def _groups(self, text: str) -> Iterator[str]:
        """`text` cut after cut tokens, in groups of at least `min_chars` characters but
        the last (which also holds the text after the last cut)."""
        start = 0
        for match in self._cut.finditer(text):
            if match.end() - start >= self._min_chars:
                yield text[start:match.end()]
                start = match.end()
        if start < len(text):
            yield text[start:]

    def _get(self, group: str) -> array | None:
        ids = self._entries.get(group)
        if ids is not None:
            self._entries.move_to_end(group)
        return ids

    def _put(self, group: str, ids: array) -> None:
        if len(group) > self.max_chars:
            return
        with self._lock:
            if group in self._entries:  # another thread encoded it meanwhile
                return
            # Room first, so that `chars`, read without the lock, never exceeds the bound.
            while self._chars + len(group) > self.max_chars:
                evicted, _ = self._entries.popitem(last=False)
                self._chars -= len(evicted)
            self._entries[group] = ids
            self._chars += len(group)


def _check_encode_path(tokenizer: Any) -> None:
    try:  # transformers 5's base of every Rust-backed tokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError as error:
        raise NotCacheable(f"this transformers has no TokenizersBackend: {error}") from None

    if not isinstance(tokenizer, TokenizersBackend):
        raise NotCacheable(f"{type(tokenizer).__name__} is not transformers' TokenizersBackend")
    for name in _ENCODE_PATH:
        if getattr(type(tokenizer), name) is not getattr(TokenizersBackend, name):
            raise NotCacheable(f"{type(tokenizer).__name__} overrides {name}")


def _check_pipeline(backend: Any) -> None:
    """Raises NotCacheable unless every step of `backend` sees only its piece."""
    model = type(backend.model).__name__
    if model not in _PIECE_MODELS:
        raise NotCacheable(f"model {model}")
    if model == "BPE" and backend.model.dropout:
        raise NotCacheable("BPE dropout")
    for kind, allowed in (("normalizer", _PIECE_NORMALIZERS),
                          ("pre_tokenizer", _PIECE_PRE_TOKENIZERS),
                          ("post_processor", _SPECIAL_ONLY_PROCESSORS)):
        for step in component_steps(getattr(backend, kind)):
            if step["type"] not in allowed:
                raise NotCacheable(f"{kind} {step['type']}")
            if step["type"] == "Metaspace" and step.get("prepend_scheme") not in ("always",
                                                                                  "never"):
                raise NotCacheable(f"Metaspace with prepend_scheme {step.get('prepend_scheme')}")


def component_steps(component: Any) -> list[dict[str, Any]]:
    """The steps of a Rust tokenizer's component (its normalizer, pre-tokenizer,
    post-processor or decoder), each its JSON, Sequences flattened; none for None."""
    return [] if component is None else list(_steps(json.loads(component.__getstate__())))


def _steps(state: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if state["type"] != "Sequence":
        yield state
        return
    for key in ("normalizers", "pretokenizers", "processors", "decoders"):
        for step in state.get(key, ()):
            yield from _steps(step)


def _template_text(template: str | dict[str, str] | None) -> str:
    """All the text of a chat template (transformers allows several, by name)."""
    if isinstance(template, dict):
        return "\n".join(template.values())
    return template or ""


def _why_not_cut(token: Any, raw: list[Any], single_word: bool) -> str | None:
    """Why text cannot be cut right after `token` (an AddedToken); None when it can.
    `raw`: the added tokens matched on raw text; `single_word`: whether one of them is."""
    content = token.content
    if token.lstrip or token.rstrip or token.single_word:
        return "strips spaces or must be a single word"
    if single_word and _word_like(content[-1]):
        return "ends with a word character and a single_word token could follow"
    starts = {content[:k] for k in range(1, len(content))}
    inner = set(content[:-1])
    for other in (other.content for other in raw):
        if other != content and content in other:
            return f"is inside the added token {other!r}"
        if other[-1:] in inner and any(other.endswith(start) for start in starts
                                       if len(start) < len(other)):
            return f"can start inside the added token {other!r}"
    return None


def _word_like(char: str) -> bool:
    """Whether `char` may count as a word character for the Rust tokenizer's `\\w`
    (anything outside ASCII punctuation, to stay clear of Unicode table differences)."""
    return not (char.isascii() and not char.isalnum() and char != "_")
