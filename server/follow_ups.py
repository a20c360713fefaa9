"""Whether a model's chats come back for another turn.

A next-turn guess (server/next_turn.py) costs a prefill forward of its own for every
reply, and only a chat's next turn reads it. Where chats end after one turn (one-shot
prompts behind a shared system prompt, RAG questions, a title generator), every guess is
a forward no request reads: on an H200 the shared-prefix workload lost 5-13% of its
throughput to them. A chat that continues sends its earlier replies back as assistant
messages, so the share of recent chat requests that carry one says whether guessing pays;
it does not depend on the guesses themselves, so it notices conversations coming back
the moment they do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

# The chat requests the share is taken over, and the fewest it needs before guessing is
# ever turned off (a server's first requests guess, as every one did before).
WINDOW = 32
MIN_SEEN = 8
# Below this share of continuing chats, a guess is not made. In a conversation of n turns,
# n - 1 of its requests carry a reply, so even two-turn chats among one-shot prompts
# keep it on.
MIN_SHARE = 1 / 8


class FollowUps:
    """The last WINDOW chat requests of one model, each as whether it continued a chat."""

    def __init__(self) -> None:
        self._recent: deque[bool] = deque(maxlen=WINDOW)

    def note(self, messages: Sequence[Mapping[str, Any]]) -> None:
        self._recent.append(any(message.get("role") == "assistant" for message in messages))

    def worth_guessing(self) -> bool:
        seen = len(self._recent)
        return seen < MIN_SEEN or sum(self._recent) >= MIN_SHARE * seen
