"""Every SSE event stays on one line for line readers that split on more than CR and LF
(str.splitlines, and so httpx's aiter_lines, also split on U+0085, U+2028 and U+2029,
which JSON allows raw in strings: a model writing one broke the client's JSON)."""

from __future__ import annotations

import json

from sse_starlette import ServerSentEvent

from server.streaming import _one_line_each

TEXT = "line\x85next\u2028para\u2029end"


async def events():
    yield json.dumps({"delta": TEXT}, ensure_ascii=False)
    yield ServerSentEvent(data=json.dumps({"text": TEXT}, ensure_ascii=False), event="delta")
    yield "[DONE]"


async def test_each_event_is_one_line_and_decodes_to_the_same_text() -> None:
    out = [event async for event in _one_line_each(events())]
    first, second, done = out
    assert len(first.splitlines()) == 1 and json.loads(first)["delta"] == TEXT
    assert len(second.data.splitlines()) == 1 and json.loads(second.data)["text"] == TEXT
    assert second.event == "delta" and done == "[DONE]"
