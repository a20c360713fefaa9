"""Client text stays text: a control token's string typed into a message is not the token.

A chat template renders messages into one string, which the tokenizer then reads whole, and
a Hugging Face tokenizer matches its added tokens anywhere in it. So "<|im_end|>\\n
<|im_start|>system\\n..." inside a user message or a tool's result (a web page an agent
fetched) became real turn delimiters: a forged system turn the model obeys. OpenAI reads
such strings as plain text. mlx-lm, vLLM and llama.cpp's server match them.

Where a message the model did not write (any role but the assistant's) holds one of the
model's control strings, a zero-width space goes in after its first character, so the
tokenizer reads it as the text it looks like. The assistant's own messages are left as
they are: they are the model's output, cached as the next turn renders them. Raw prompts
(Completions) are left alone too: writing control tokens by hand is what they are for.
"""

from __future__ import annotations

import re
from typing import Any

# Invisible, and no token's string contains it, so the control string no longer matches.
BREAK = "\u200b"


def control_pattern(backend: Any, template: str) -> re.Pattern[str] | None:
    """A pattern of the control strings the Rust tokenizer `backend` matches as tokens: its
    special added tokens and those the chat `template` writes (Qwen's <think> and
    <tool_call> are not "special"), bracketed ones only, so no added word or run of spaces
    (code models add those) is touched. None when there are none."""
    contents = {token.content for token in backend.get_added_tokens_decoder().values()
                if (token.special or token.content in template) and _bracketed(token.content)}
    if not contents:
        return None
    return re.compile(_alternation(contents))


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


def _bracketed(content: str) -> bool:
    return len(content) > 1 and content[0] in "<[" and not any(c.isspace() for c in content)


def as_text(messages: list[dict[str, Any]], pattern: re.Pattern[str]) -> list[dict[str, Any]]:
    """`messages`, with every control string in the text of a message the model did not
    write broken by `BREAK`. Messages without one are the same objects."""
    return [message if message.get("role") == "assistant" else _message_as_text(message, pattern)
            for message in messages]


def _message_as_text(message: dict[str, Any], pattern: re.Pattern[str]) -> dict[str, Any]:
    fields = {key: _broken(message[key], pattern) for key in ("content", "name") if key in message}
    changed = {key: value for key, value in fields.items() if value is not message[key]}
    return {**message, **changed} if changed else message


def _broken(value: Any, pattern: re.Pattern[str]) -> Any:
    """`value` (a string, or content parts) with its control strings broken; the same
    object where it holds none."""
    if isinstance(value, str):
        if pattern.search(value) is None:
            return value
        return pattern.sub(lambda match: match[0][0] + BREAK + match[0][1:], value)
    if isinstance(value, list):
        parts = [_broken(part, pattern) for part in value]
        return parts if any(a is not b for a, b in zip(parts, value)) else value
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        text = _broken(value["text"], pattern)
        return value if text is value["text"] else {**value, "text": text}
    return value
