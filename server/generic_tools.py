"""Tool calling for models whose chat template has no tool format.

SmolLM2-135M-Instruct, the default model, is one: its template ignores `tools` and has no
role for tool results (`template_ignores_tools` finds out by rendering a probe). Like
llama.cpp's generic format, the server then writes the tools into the system message
itself and asks for calls in the Hermes/Qwen shape, which is what the constrained decoder
forces when a call is required:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The same shape is how calls are read from a model whose template does render tools but
whose family mlx-lm has no tool parser for. The conversation is rewritten (for templates
that ignore tools only) so the template needs nothing but system, user and assistant
turns: an assistant turn's earlier calls become that text in its content, and
each tool result becomes a user turn holding a `<tool_response>` block (consecutive ones
are then merged into one turn, as every run of one role is: `server.conversation`).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from jinja2 import TemplateError

from engine.tokenizer import ModelTokenizer, ToolCallFormat
from server.conversation import SYSTEM_ROLES
from server.request import FunctionTool, TemplateMessage

START, END = "<tool_call>", "</tool_call>"


def _parse(text: str, tools: Any = None) -> Any:
    return json.loads(text.strip())


# Parallel calls follow one another directly. A model that does not know this format
# tends to write a newline after a closing tag out of habit (SmolLM2-135M: p=0.8, against
# 0.18 for its end of turn); a newline separator would turn that habit into a second call,
# while here the choice after a call is between its end of turn and another call's tag.
FORMAT = ToolCallFormat(START, END, _parse, separator="")
PROBE = FunctionTool("probe", "Shows whether the template renders tools.")


@functools.lru_cache(maxsize=8)
def template_ignores_tools(tokenizer: ModelTokenizer) -> bool:
    """Does the model's chat template leave `tools` out of the prompt? Rendered once per
    tokenizer; a template that fails on tools counts as ignoring them."""
    if tokenizer.tool_calls is not None:
        return False  # mlx-lm knows the family's tool format, so the template has one
    messages = [{"role": "user", "content": "?"}]
    try:
        return tokenizer.chat_prompt(messages, [PROBE.template_form()]) == (
            tokenizer.chat_prompt(messages))
    except (TemplateError, ValueError):
        return True


def instructions(tools: tuple[FunctionTool, ...]) -> str:
    """The system-message section that describes the tools and the call format. It says
    nothing of tool_choice, which agents toggle from one request to the next: the system
    prompt, and so the cached prefix, stays the same, and a forced call needs no words
    since the grammar writes it."""
    listing = "\n".join(
        json.dumps(tool.template_form(), ensure_ascii=False) for tool in tools
    )
    return (
        "# Tools\n\nYou may call one or more functions to help with the user's request. "
        f"The functions, with their parameters as JSON Schema:\n<tools>\n{listing}\n</tools>\n\n"
        "To call a function, reply with its name and arguments as a JSON object inside "
        f'{START}{END} tags:\n{START}\n{{"name": <function-name>, "arguments": '
        f"<args-json-object>}}\n{END}"
    )


def render_call(name: str, arguments: Any) -> str:
    return f"{START}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{END}"


def rewrite(
    messages: tuple[TemplateMessage, ...], tools: tuple[FunctionTool, ...]
) -> list[TemplateMessage]:
    """`messages` for a template without tools: the tool section (if any tools are
    offered) in the system message, earlier calls and results as text."""
    out: list[TemplateMessage] = []
    for message in messages:
        if message["role"] == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            out.append({"role": "user", "content": block})
            continue
        calls = [
            render_call(call["function"]["name"], call["function"]["arguments"])
            for call in message.get("tool_calls") or ()
        ]
        message = {key: value for key, value in message.items() if key != "tool_calls"}
        if calls:
            content = message.get("content")
            message["content"] = (f"{content}\n" if content else "") + FORMAT.separator.join(calls)
        out.append(message)
    if not tools:
        return out
    section = instructions(tools)
    # A developer message first (the Responses API's instructions, Codex's) is the system
    # message once the template is given it: the section follows its text as it would.
    if out and out[0]["role"] in SYSTEM_ROLES:
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{section}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": section})
    return out
