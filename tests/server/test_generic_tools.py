"""The generic tool format for templates without one: what the template is given."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_lm.tokenizer_utils import load

from engine.tokenizer import ModelTokenizer
from server.generic_tools import FORMAT, rewrite, template_ignores_tools
from server.request import FunctionTool

WEATHER = FunctionTool("get_weather", "The forecast.", {"type": "object", "properties": {}})
HISTORY = (
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Paris and Oslo?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "a", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": city}}}
        for city in ("Paris", "Oslo")]},
    {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "b", "content": "rain"},
)


def test_tools_join_the_system_message_and_turns_become_text() -> None:
    system, user, assistant, *results = rewrite(HISTORY, (WEATHER,))
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER.template_form()) in system["content"]
    assert user == HISTORY[1]
    assert assistant == {"role": "assistant", "content": (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call><tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        "</tool_call>")}  # parallel calls follow one another directly in this format
    # One user turn per result; the shared pipeline merges the run (test_conversation).
    assert results == [{"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
                       for text in ("sunny", "rain")]


def test_tools_follow_a_first_developer_messages_text_as_a_system_messages() -> None:
    developer = {"role": "developer", "content": "Be brief."}
    first, user = rewrite((developer, HISTORY[1]), (WEATHER,))
    assert first["role"] == "developer" and first["content"].startswith("Be brief.\n\n# Tools")
    assert user == HISTORY[1]


def test_without_a_system_message_the_tools_make_one() -> None:
    [system, user] = rewrite(HISTORY[1:2], (WEATHER,))
    assert system["content"].startswith("# Tools") and "<tools>" in system["content"]
    assert user == HISTORY[1]


def test_without_tools_only_the_history_is_rewritten() -> None:
    assert [m["role"] for m in rewrite(HISTORY, ())] == [
        "system", "user", "assistant", "user", "user"]
    assert rewrite(HISTORY[:2], ()) == list(HISTORY[:2])


def test_its_calls_parse_back() -> None:
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert FORMAT.parse(f"\n{json.dumps(call)}\n", None) == call


def test_the_probe_tells_templates_with_tools_from_those_without(
    demo_model_dir: Path, real_model_dir: Path
) -> None:
    """The demo template renders tools; SmolLM2's ignores them."""
    assert not template_ignores_tools(ModelTokenizer(load(demo_model_dir)))
    assert template_ignores_tools(ModelTokenizer(load(real_model_dir)))
