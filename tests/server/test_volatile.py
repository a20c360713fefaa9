"""Per-request system-prompt lines are dropped before templating, and only those."""

from __future__ import annotations

import pytest

from server.config import Settings
from server.volatile import drop_volatile_lines

BILLING = "x-anthropic-billing-header: cc_version=2.1.117.48f; cc_entrypoint=cli; cch=71fea;"


def test_claude_codes_billing_line_is_dropped_by_default() -> None:
    messages = [
        {"role": "system", "content": f"{BILLING}\nYou are Claude Code.\nBe careful."},
        {"role": "user", "content": BILLING},
    ]
    stable = drop_volatile_lines(messages, Settings().volatile_system_lines)
    assert stable[0]["content"] == "You are Claude Code.\nBe careful."
    assert stable[1] == messages[1]  # only system prompts are touched


def test_a_pattern_must_match_a_whole_line() -> None:
    messages = [{"role": "system", "content": "date: today\nkeep: date: today\n"}]
    assert drop_volatile_lines(messages, [r"date: \w+"])[0]["content"] == "keep: date: today\n"
    assert drop_volatile_lines(messages, []) == tuple(messages)


def test_a_bad_pattern_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="not a regular expression"):
        Settings(volatile_system_lines=["cch=(["])
