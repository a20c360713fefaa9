"""A chat's messages in the shape chat templates accept, whatever API sent them.

Agents send two shapes that many templates refuse:

- Runs of one role. Codex sends developer, developer, user, user; a template that enforces
  alternation (Gemma 3's) raises on it. A run becomes one message, its texts joined by a
  blank line (an assistant run also joins its tool calls and reasoning).
- The developer role, OpenAI's successor to the system message, which Codex and the
  OpenAI SDKs send. A template that does not name it (all but gpt-oss's) would render a
  turn of a role its model never saw, or refuse it (Gemma 3's): it becomes a system
  message, and joins the system messages around it.
- System messages after the conversation has begun (Claude Code's mid-conversation system
  messages). A template that renders a system turn anywhere (ChatML, Llama 3) gets them
  where they are. For one that does not (Gemma 3's has a system prompt only up front), the
  message becomes user text at its place, which joins the neighbouring user turn: moving
  it into the leading system prompt instead would change the prompt's first tokens, so
  nothing of the conversation could come from the prefix cache.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from jinja2 import TemplateError

from engine.tokenizer import ModelTokenizer
from server.request import TemplateMessage

SYSTEM_ROLES = ("system", "developer")
# Tool results answer one call each (tool_call_id): they are never merged.
MERGED_ROLES = (*SYSTEM_ROLES, "user", "assistant")
PROBE_TEXT = "late-system-probe"


@functools.lru_cache(maxsize=8)
def renders_late_system(tokenizer: ModelTokenizer) -> bool:
    """Does the model's template render a system message after a user and an assistant
    turn? Rendered once per tokenizer; a template that raises on it does not."""
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"},
                {"role": "system", "content": PROBE_TEXT}, {"role": "user", "content": "?"}]
    try:
        return PROBE_TEXT in tokenizer.decode(tokenizer.chat_prompt(messages))
    except (TemplateError, ValueError):
        return False


def knows_developer(tokenizer: ModelTokenizer) -> bool:
    """Does the model's chat template name the developer role (gpt-oss's renders it as
    a turn of its own)?"""
    return "developer" in tokenizer.chat_template_text


def normalize(messages: Sequence[TemplateMessage], late_system: bool,
              developer: bool = False) -> list[TemplateMessage]:
    """`messages` with developer messages made system ones unless `developer` (the
    template knows the role), and system messages after the first other one kept as such
    only when `late_system` (the template renders them), else made user text; then every
    run of one role merged into one message."""
    started = False
    out: list[TemplateMessage] = []
    for message in messages:
        if message["role"] == "developer" and not developer:
            message = {**message, "role": "system"}
        role = message["role"]
        if role in SYSTEM_ROLES and started and not late_system:
            message = {"role": "user", "content": message.get("content") or ""}
        started = started or role not in SYSTEM_ROLES
        if out and message["role"] == out[-1]["role"] and message["role"] in MERGED_ROLES:
            out[-1] = _merged(out[-1], message)
        else:
            out.append(message)
    return out


def _merged(first: TemplateMessage, second: TemplateMessage) -> TemplateMessage:
    merged = {**first, **second}
    for key in ("content", "reasoning_content"):
        texts = [text for text in (first.get(key), second.get(key)) if text]
        if texts or key in merged:
            merged[key] = "\n\n".join(texts)
    calls = [*(first.get("tool_calls") or ()), *(second.get("tool_calls") or ())]
    if calls:
        merged["tool_calls"] = calls
    return merged
