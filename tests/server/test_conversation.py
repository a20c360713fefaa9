"""Messages fitted to chat templates: runs of one role merged, late system messages kept
where the template renders them, else made user text at their place."""

from __future__ import annotations

from pathlib import Path

from mlx_lm.tokenizer_utils import load

from engine.tokenizer import ModelTokenizer
from server.conversation import knows_developer, normalize, renders_late_system


def test_codex_runs_of_one_role_become_one_message_each() -> None:
    messages = [
        {"role": "developer", "content": "Be careful."},
        {"role": "developer", "content": "Use the shell."},
        {"role": "user", "content": "<environment_context/>"},
        {"role": "user", "content": "List the files."},
    ]
    assert normalize(messages, late_system=True, developer=True) == [
        {"role": "developer", "content": "Be careful.\n\nUse the shell."},
        {"role": "user", "content": "<environment_context/>\n\nList the files."},
    ]


def test_a_developer_message_is_a_system_one_where_the_template_lacks_the_role() -> None:
    messages = [{"role": "system", "content": "You are an agent."},
                {"role": "developer", "content": "Use the shell."},
                {"role": "user", "content": "Hi."}]
    assert normalize(messages, late_system=False) == [
        {"role": "system", "content": "You are an agent.\n\nUse the shell."}, messages[2]]


def test_an_assistant_run_joins_text_calls_and_reasoning() -> None:
    call = {"id": "a", "type": "function", "function": {"name": "ls", "arguments": {}}}
    messages = [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "Hm."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "a", "content": "x"},
        {"role": "tool", "tool_call_id": "b", "content": "y"},
    ]
    merged = normalize(messages, late_system=True)
    assert merged[1] == {"role": "assistant", "content": "Looking.", "reasoning_content": "Hm.",
                         "tool_calls": [call]}
    assert [m["role"] for m in merged] == ["user", "assistant", "tool", "tool"]  # one per call


def test_a_late_system_message_stays_or_joins_the_next_user_turn() -> None:
    messages = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "The user switched to plan mode."},
        {"role": "user", "content": "Plan it."},
    ]
    assert normalize(messages, late_system=True) == messages
    assert normalize(messages, late_system=False) == [
        *messages[:3], {"role": "user", "content": "The user switched to plan mode.\n\nPlan it."}]


def test_the_probes_tell_what_a_template_renders(real_model_dir: Path) -> None:
    """SmolLM2's ChatML template renders every message as a turn of its role, and names
    no developer role."""
    tokenizer = ModelTokenizer(load(real_model_dir))
    assert renders_late_system(tokenizer) and not knows_developer(tokenizer)
