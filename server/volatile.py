"""System-prompt lines that change with every request, dropped before templating.

A prefix cache reuses a prompt only up to its first differing token. Claude Code starts
its system prompt with a billing line whose hash changes on every request
(`x-anthropic-billing-header: cc_version=...; cc_entrypoint=cli; cch=71fea;`), so without
this nothing after it (system prompt, tools, the whole conversation) would ever come from
the cache. The line means nothing to a local model. The patterns are a setting
(`volatile_system_lines`); each must match a whole line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

from server.request import TemplateMessage


@lru_cache(maxsize=8)
def _compiled(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    return re.compile("|".join(f"(?:{pattern})" for pattern in patterns)) if patterns else None


def drop_volatile_lines(
    messages: Sequence[TemplateMessage], patterns: Sequence[str]
) -> tuple[TemplateMessage, ...]:
    """`messages` with every system message's matching lines removed."""
    pattern = _compiled(tuple(patterns))
    if pattern is None:
        return tuple(messages)
    return tuple(
        {**message, "content": _drop_lines(message["content"], pattern)}
        if message["role"] == "system" and isinstance(message.get("content"), str) else message
        for message in messages
    )


def _drop_lines(text: str, pattern: re.Pattern[str]) -> str:
    return "".join(
        line for line in text.splitlines(keepends=True)
        if not pattern.fullmatch(line.rstrip("\r\n"))
    )
