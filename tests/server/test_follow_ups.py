"""Whether a model's chats continue decides whether replies are prefilled as next turns
(server/follow_ups.py)."""

from __future__ import annotations

from server.follow_ups import MIN_SEEN, WINDOW, FollowUps

ONE_SHOT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
FOLLOW_UP = [*ONE_SHOT, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "And?"}]


def noted(*chats: list[dict]) -> FollowUps:
    follow_ups = FollowUps()
    for chat in chats:
        follow_ups.note(chat)
    return follow_ups


def test_a_new_server_guesses_until_it_has_seen_enough_chats() -> None:
    assert noted().worth_guessing()
    assert noted(*[ONE_SHOT] * (MIN_SEEN - 1)).worth_guessing()
    assert not noted(*[ONE_SHOT] * MIN_SEEN).worth_guessing()


def test_one_continuing_chat_in_eight_keeps_guessing() -> None:
    assert noted(*[ONE_SHOT] * 7, FOLLOW_UP).worth_guessing()
    assert not noted(*[ONE_SHOT] * 8, FOLLOW_UP).worth_guessing()
    assert noted(*[ONE_SHOT] * 14, FOLLOW_UP, FOLLOW_UP).worth_guessing()


def test_only_the_last_window_of_chats_counts() -> None:
    follow_ups = noted(*[FOLLOW_UP] * WINDOW, *[ONE_SHOT] * WINDOW)
    assert not follow_ups.worth_guessing()
    for _ in range(WINDOW // 8):
        follow_ups.note(FOLLOW_UP)
    assert follow_ups.worth_guessing()


def test_an_agents_tool_results_continue_its_chat() -> None:
    """A tool call comes back as the assistant message that made it."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    agent = [*ONE_SHOT, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert noted(*[ONE_SHOT] * 7, agent).worth_guessing()
