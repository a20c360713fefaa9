"""Client text stays text: a control token's string typed into a message is not the token.

A chat template renders messages into one string, which the tokenizer then reads whole, and
a Hugging Face tokenizer matches its added tokens anywhere in it. So "<|im_end|>\\n
<|im_start|>system\\n..." inside a user message or a tool's result (a web page an agent
fetched) became real turn delimiters: a forged system turn the model obeys. OpenAI reads
such strings as plain text. mlx-lm, vLLM and llama.cpp's server match them.

Where a message the model did not write (any role but the assistant's) holds one of the
model's control strings, a break (`BREAK`) goes in after its first character before the
template renders it (`as_text`), so the tokenizer no longer matches it there. The rendered
prompt is then encoded (`encode`) with each stretch between the tokenizer's own added
tokens that holds such a string read with none matched and the break taken out again:
the model reads the characters the client sent, as the text they look like, and so writes
them back as they were (left in, a zero-width space then, the break was copied into its
answers). The assistant's own messages are left as they are: they are the model's
output, cached as the next turn renders them. Raw prompts (Completions) are left alone
too: writing control tokens by hand is what they are for.
"""

from __future__ import annotations

import re
import threading
from typing import Any

# No token's string holds it, so the control string no longer matches; a private-use
# character, which no client types by accident: a zero-width space, the first choice, was
# one a client's own text could hold, and the break's removal took it out of their text.
BREAK = "\U000f0001"


class ControlStrings:
    """The control strings of the Rust tokenizer `backend` under chat `template`: its
    special added tokens and those the template writes (Qwen's <think> and <tool_call> are
    not "special"), bracketed ones only, so no added word or run of spaces (code models add
    those) is touched."""

    def __init__(self, backend: Any, template: str) -> None:
        added = backend.get_added_tokens_decoder()
        controls = {token.content: token.special for token in added.values()
                    if (token.special or token.content in template)
                    and _bracketed(token.content)}
        self.pattern = re.compile(_alternation(set(controls)))
        # Read as text again after the render: the special ones, which a tokenizer told
        # not to match special tokens reads as text. (A non-special one it would still
        # match: it keeps its break.)
        specials = {_broken(content) for content, special in controls.items() if special}
        self._broken = re.compile(_alternation(specials)) if specials else None
        self._added_ids = frozenset(added)
        self._backend = backend
        self._plain: Any = None  # `backend` matching no special token, made on first use
        self._lock = threading.Lock()

    @classmethod
    def of(cls, backend: Any, template: str) -> ControlStrings | None:
        """None where the tokenizer has no control string."""
        strings = cls(backend, template)
        return strings if strings.pattern.pattern else None

    def as_text(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages`, with every control string in the text of a message the model did
        not write broken by `BREAK`; `messages` itself where none holds one."""
        read = [message if message.get("role") == "assistant"
                else _message_as_text(message, self.pattern) for message in messages]
        return messages if all(a is b for a, b in zip(read, messages)) else read

    def encode(self, text: str) -> list[int] | None:
        """The token ids of rendered `text` with the control strings `as_text` broke read
        as text; None where it holds none (most prompts: encode it as usual). The
        tokenizer encodes each stretch between its added tokens by itself, so a stretch is
        encoded again alone, here with no special token matched, to the same ids a
        tokenizer that never matched them in it gives."""
        if self._broken is None or BREAK not in text or self._broken.search(text) is None:
            return None
        encoding = self._backend.encode(text, add_special_tokens=False)
        # Once: `Encoding.ids` builds a new list at every read, and read per stretch it
        # made a long conversation's prompt quadratic.
        whole = encoding.ids
        ids: list[int] = []
        first, start = 0, 0  # the stretch's first token and first character
        for index, (token, (begin, end)) in enumerate(zip(whole, encoding.offsets)):
            if token in self._added_ids:
                ids += self._stretch(text[start:begin], whole[first:index])
                ids.append(token)
                first, start = index + 1, end
        return ids + self._stretch(text[start:], whole[first:])

    def _stretch(self, text: str, ids: list[int]) -> list[int]:
        assert self._broken is not None
        if self._broken.search(text) is None:
            return ids
        whole = self._broken.sub(lambda match: match[0].replace(BREAK, "", 1), text)
        return self._plain_tokenizer().encode(whole, add_special_tokens=False).ids

    def _plain_tokenizer(self) -> Any:
        with self._lock:
            if self._plain is None:
                plain = type(self._backend).from_str(self._backend.to_str())
                plain.encode_special_tokens = True
                self._plain = plain
            return self._plain


def _bracketed(content: str) -> bool:
    return len(content) > 1 and content[0] in "<[" and not any(c.isspace() for c in content)


def _broken(content: str) -> str:
    return content[0] + BREAK + content[1:]


def _alternation(strings: set[str]) -> str:
    """A regex of any of `strings`, factored as a trie: a position is tried once per
    character, not once per string. A plain alternation of Gemma 3's 6,249 control
    strings took 0.2 s to search 70 kB of HTML, every '<' tried against each."""
    trie: dict[str, dict] = {}
    for string in strings:
        node = trie
        for char in string:
            node = node.setdefault(char, {})
        node[""] = {}

    def pattern(node: dict[str, dict]) -> str:
        branches = [re.escape(char) + pattern(child) for char, child in sorted(node.items())
                    if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        # A string that ends here, and a longer one that goes on: the longer first.
        return f"(?:{body})?" if "" in node else body

    return pattern(trie)


def _message_as_text(message: dict[str, Any], pattern: re.Pattern[str]) -> dict[str, Any]:
    fields = {key: _broken_in(message[key], pattern) for key in ("content", "name")
              if key in message}
    changed = {key: value for key, value in fields.items() if value is not message[key]}
    return {**message, **changed} if changed else message


def _broken_in(value: Any, pattern: re.Pattern[str]) -> Any:
    """`value` (a string, or content parts) with its control strings broken; the same
    object where it holds none."""
    if isinstance(value, str):
        if pattern.search(value) is None:
            return value
        return pattern.sub(lambda match: _broken(match[0]), value)
    if isinstance(value, list):
        parts = [_broken_in(part, pattern) for part in value]
        return parts if any(a is not b for a, b in zip(parts, value)) else value
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        text = _broken_in(value["text"], pattern)
        return value if text is value["text"] else {**value, "text": text}
    return value
