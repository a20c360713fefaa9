"""OpenAI's Responses API end to end: the official `openai` SDK (`client.responses`) and
raw HTTP against the shared server process on the tiny demo model (random weights: these
tests check shapes, the event sequence, stored responses, usage and the cache)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Literal

import httpx
import openai
import pytest
from openai.types.responses import ResponseInputMessageItem, ResponseItem, ResponseOutputMessage
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from engine.image_tokens import MARKER
from server.anthropic.adapter import chat_messages
from server.anthropic.protocol import AnthropicMessage
from server.responses.adapter import (
    IMAGES,
    assistant_message,
    input_messages,
    with_current_markers,
)
from server.responses.protocol import (
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponsesRequest,
)
from server.responses.protocol import Response as ResponseObject
from tests.server.support import API_KEY, ServerProcess

TOOLS = [{
    "type": "function", "name": "shell", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]},
}]
RESPONSE_ITEM = TypeAdapter(ResponseItem)


def test_response_shape_and_usage(client: openai.OpenAI, model_id: str) -> None:
    response = client.responses.create(model=model_id, input="Say something.",
                                       instructions="Be terse.", max_output_tokens=16)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == model_id and response.instructions == "Be terse."
    [item] = response.output
    assert item.type == "message" and item.role == "assistant"
    assert item.status == response.status  # a message cut short is incomplete too
    assert [part.type for part in item.content] == ["output_text"]
    assert response.output_text == item.content[0].text
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 <= usage.input_tokens_details.cached_tokens < usage.input_tokens
    if usage.output_tokens == 16:  # random weights rarely end on their own
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


def test_the_response_echoes_the_requests_settings(client: openai.OpenAI, model_id: str) -> None:
    """The settings a response was made with come back on it, as OpenAI's: those left
    out as their defaults, in the stream's first event and the stored response too."""
    plain = client.responses.create(model=model_id, input="Hi", max_output_tokens=16)
    assert (plain.truncation, plain.service_tier, plain.background) == ("disabled", "default",
                                                                        False)
    assert plain.reasoning.effort is None and plain.reasoning.summary is None
    assert plain.safety_identifier is None and plain.max_tool_calls is None
    assert plain.prompt_cache_retention is None
    assert (plain.temperature, plain.top_p) == (1.0, 1.0)  # OpenAI's defaults, sampled at
    asked = {"truncation": "auto", "reasoning": {"effort": "low", "summary": "auto"},
             "safety_identifier": "user-7", "service_tier": "flex", "max_tool_calls": 3,
             "store": True, "text": {"verbosity": "low"}, "prompt_cache_retention": "24h",
             # Metadata at OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512.
             "metadata": {f"{i:02}".ljust(64, "k"): "v" * 512 for i in range(16)},
             "temperature": 0.5, "top_p": 0.9}
    response = client.responses.create(model=model_id, input="Hi", max_output_tokens=16,
                                       **asked)
    with client.responses.stream(model=model_id, input="Hi", max_output_tokens=16,
                                 **asked) as stream:
        created = next(iter(stream)).response
    stored = client.responses.retrieve(response.id)
    for echoed in (response, created, stored):
        assert echoed.truncation == "auto" and echoed.safety_identifier == "user-7"
        assert (echoed.reasoning.effort, echoed.reasoning.summary) == ("low", "auto")
        assert echoed.max_tool_calls == 3 and echoed.prompt_cache_retention == "24h"
        assert echoed.service_tier == "default"  # the tier that served it: there is one
        assert echoed.metadata == asked["metadata"]
        assert (echoed.temperature, echoed.top_p) == (0.5, 0.9)
        # The format left out is the default's, as the verbosity sent is.
        assert echoed.text.format.type == "text" and echoed.text.verbosity == "low"


def test_stream_follows_the_documented_event_sequence(
    client: openai.OpenAI, model_id: str
) -> None:
    options = {"model": model_id, "input": "Hello", "max_output_tokens": 16, "temperature": 0.0}
    whole = client.responses.create(**options)
    events = list(client.responses.create(**options, stream=True))
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete" if whole.status == "incomplete" else "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert final.id == events[0].response.id and final.status == whole.status
    assert final.output_text == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        whole.output_text
    # The same prompt again: all of it but the last token came from the cache.
    assert final.usage.input_tokens_details.cached_tokens == final.usage.input_tokens - 1


def test_previous_response_continues_the_stored_conversation(
    client: openai.OpenAI, model_id: str
) -> None:
    # Greedy: a sampled reply that opens with whitespace ("\n\n", "  ") joins the generation
    # prompt's last newline into one token when the conversation is rendered again, so no
    # cache could serve that token, and which reply a shared server samples depends on the
    # requests other test files sent it before.
    first = client.responses.create(model=model_id, input="Remember the word apple.",
                                    max_output_tokens=16, temperature=0)
    follow = client.responses.create(model=model_id, input="Which word?", max_output_tokens=16,
                                     previous_response_id=first.id, temperature=0)
    assert follow.previous_response_id == first.id
    # The first exchange is the follow-up's prompt prefix, and came from the cache.
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_input_tokens_are_counted_as_the_response_would_read_them(
    client: openai.OpenAI, model_id: str
) -> None:
    """POST /v1/responses/input_tokens: the prompt a request would make, instructions,
    tools and a previous response's conversation included, counted without running it."""
    ask = {"model": model_id, "input": "Which shell?", "instructions": "Be terse.",
           "tools": TOOLS}
    first = client.responses.create(**ask, max_output_tokens=16)
    count = client.responses.input_tokens.count(**ask)
    assert count.object == "response.input_tokens"
    assert count.input_tokens == first.usage.input_tokens
    follow = {**ask, "input": "And then?", "previous_response_id": first.id}
    counted = client.responses.input_tokens.count(**follow).input_tokens
    assert counted == client.responses.create(**follow, max_output_tokens=16).usage.input_tokens
    with pytest.raises(openai.BadRequestError) as unknown:
        client.responses.input_tokens.count(**{**follow, "previous_response_id": "resp_x"})
    assert unknown.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError):
        client.responses.input_tokens.count(model=model_id, input=[{"type": "nope"}])


def test_a_stream_closed_at_its_terminal_event_is_stored(
        model_id: str, server: ServerProcess) -> None:
    """Clients stop reading at response.completed (the SDKs' `break`) and close the
    stream: the response was stored before that event went out. It used to be stored
    after the stream's last write, which a closed stream never reaches (9 of 20 lost)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for attempt in range(10):
        body = {"model": model_id, "input": f"Hello {attempt}.", "max_output_tokens": 16,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/responses", json=body, headers=headers,
                          timeout=60) as stream:
            for line in stream.iter_lines():
                event = json.loads(line[5:]) if line.startswith("data:") else {}
                if event.get("type") in ("response.completed", "response.incomplete"):
                    break
        stored = httpx.get(f"{server.url}/v1/responses/{event['response']['id']}",
                           headers=headers, timeout=30)
        assert (attempt, stored.status_code) == (attempt, 200)


def test_a_conversation_stored_with_the_former_image_marker_keeps_its_images() -> None:
    """A SQLite store keeps conversations across upgrades: one stored when a lone U+FFFC
    marked an image reads with today's marker; a message with no image keeps its U+FFFC
    as the text it is."""
    image = {"role": "user", "content": "\ufffc\nWhat is it?", IMAGES: ["data:image/png"]}
    assert with_current_markers(image)["content"] == f"{MARKER}\nWhat is it?"
    current = {**image, "content": f"{MARKER} \ufffc"}
    text = {"role": "user", "content": "See \ufffc here."}
    assert with_current_markers(current) == current and with_current_markers(text) == text


def test_logprobs_are_the_chat_apis_whole_and_streamed(
    client: openai.OpenAI, model_id: str
) -> None:
    """include's message.output_text.logprobs (with top_logprobs alternatives) gives each
    answer token's logprob on its output_text part and its delta events, as Chat
    Completions gives them for the same conversation."""
    asked = {"model": model_id, "input": "Say something.", "max_output_tokens": 16,
             "temperature": 0, "top_logprobs": 2, "include": ["message.output_text.logprobs"]}
    chat = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Say something."}],
        max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    whole = client.responses.create(**asked)
    assert whole.top_logprobs == 2
    assert [entry.model_dump() for entry in whole.output[0].content[0].logprobs] == expected
    assert "".join(entry["token"] for entry in expected) == whole.output_text
    with client.responses.stream(**asked) as stream:
        events = list(stream)
    deltas = [entry.model_dump() for event in events if event.type == "response.output_text.delta"
              for entry in event.logprobs]
    done = next(event for event in events if event.type == "response.output_text.done")
    assert deltas == [entry.model_dump() for entry in done.logprobs] == expected
    plain = client.responses.create(**{**asked, "top_logprobs": None, "include": None})
    assert plain.output[0].content[0].logprobs == []


def test_input_may_be_left_out(client: openai.OpenAI, model_id: str) -> None:
    """`input` is optional in OpenAI's API, and the SDK leaves it out where the caller
    does: instructions alone are answered, and a stored response goes on as it stands."""
    alone = client.responses.create(model=model_id, instructions="Say hi.", max_output_tokens=16)
    assert alone.usage.input_tokens > 0 and alone.output_text
    more = client.responses.create(model=model_id, previous_response_id=alone.id,
                                   max_output_tokens=16)
    assert more.previous_response_id == alone.id and more.usage.input_tokens > 0
    assert client.responses.input_items.list(more.id).data == []


def test_a_refusal_sent_back_reads_as_its_text(client: openai.OpenAI, model_id: str) -> None:
    """An earlier response's refusal part, replayed as input (the Agents SDK's
    to_input_list), is the assistant's text, as if it had been output_text."""
    def prompt_tokens(part: dict) -> int:
        return client.responses.create(model=model_id, max_output_tokens=16, input=[
            {"role": "user", "content": "Tell me a secret."},
            {"type": "message", "role": "assistant", "content": [part]},
            {"role": "user", "content": "Why not?"}]).usage.input_tokens

    assert prompt_tokens({"type": "refusal", "refusal": "I can't share that."}) == \
        prompt_tokens({"type": "output_text", "text": "I can't share that."})


def test_a_messages_text_parts_are_a_line_apart_as_chat_completions_parts_are(
        client: openai.OpenAI, model_id: str) -> None:
    """A message of several input_text parts reads as Chat Completions' text parts do, and
    as vLLM's Responses API joins them: a line apart. They used to be glued together
    ("Read the file.Then fix it.")."""
    parts = ["Read the file.", "Then fix it."]
    responses = client.responses.input_tokens.count(model=model_id, input=[
        {"role": "user", "content": [{"type": "input_text", "text": text} for text in parts]}])
    chat = client.chat.completions.create(model=model_id, max_tokens=1, messages=[
        {"role": "user", "content": [{"type": "text", "text": text} for text in parts]}])
    spelled = client.responses.input_tokens.count(model=model_id, input="\n".join(parts))
    assert responses.input_tokens == chat.usage.prompt_tokens == spelled.input_tokens


def test_unknown_or_unstored_response_is_404_and_an_unknown_previous_one_400(
        client: openai.OpenAI, model_id: str) -> None:
    """OpenAI's own codes: Codex's proxies resend the whole conversation on
    previous_response_not_found."""
    unstored = client.responses.create(model=model_id, input="x", max_output_tokens=16,
                                       store=False)
    for previous in ("resp_nope", unstored.id):
        with pytest.raises(openai.BadRequestError) as raised:
            client.responses.create(model=model_id, input="x", previous_response_id=previous)
        assert raised.value.code == "previous_response_not_found"
        assert raised.value.param == "previous_response_id"
        assert raised.value.body["message"] == f"Previous response with id '{previous}' not found."
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(unstored.id)
    assert missing.value.code == "response_not_found"


def test_a_stored_responses_input_items_are_listed_page_by_page(
        client: openai.OpenAI, model_id: str, server: ServerProcess) -> None:
    """The SDK's `responses.input_items.list`: the request's own items (instructions and
    earlier responses are not input items), each with an id (the client's, or one made),
    newest first unless asked otherwise, paged by `after`."""
    items = [
        {"role": "user", "content": "List the files."},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "id": "fc_mine",
         "arguments": '{"command": "ls"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md\n"},
        {"role": "user", "content": [{"type": "input_text", "text": "And now?"}]},
    ]
    response = client.responses.create(model=model_id, input=items, tools=TOOLS,
                                       instructions="Be brief.", max_output_tokens=16)
    listed = list(client.responses.input_items.list(response.id, order="asc"))
    assert [item.type for item in listed] == [
        "message", "function_call", "function_call_output", "message"]
    assert listed[0].role == "user" and listed[0].content[0].text == "List the files."
    assert listed[1].id == "fc_mine" and listed[1].call_id == "call_1"
    assert listed[2].output == "README.md\n"
    assert len({item.id for item in listed}) == 4 and all(item.id for item in listed)
    newest_first = client.responses.input_items.list(response.id, limit=3)
    assert [item.id for item in newest_first.data] == [item.id for item in listed[::-1][:3]]
    assert newest_first.has_more and newest_first.last_id == listed[1].id
    rest = client.responses.input_items.list(response.id, limit=3, after=listed[1].id)
    assert [item.id for item in rest.data] == [listed[0].id] and not rest.has_more
    follow_up = client.responses.create(model=model_id, input="Thanks.", max_output_tokens=16,
                                        previous_response_id=response.id)
    (only,) = client.responses.input_items.list(follow_up.id).data
    assert only.type == "message" and only.content[0].text == "Thanks."


def test_listed_input_items_are_the_sdks_response_items(
        client: openai.OpenAI, model_id: str, server: ServerProcess) -> None:
    """Each listed item validates as the SDK's ResponseItem: an assistant message sent
    back is listed as OpenAI lists it, a ResponseOutputMessage whose output_text parts
    carry their `annotations` (none). They used to be listed as sent, without them, and
    validated as no ResponseItem."""
    items = [
        {"role": "user", "content": "a"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "ok"}]},
        {"role": "assistant", "content": "fine"},
        {"role": "user", "content": [{"type": "input_text", "text": "b"}]},
    ]
    response = client.responses.create(model=model_id, input=items, max_output_tokens=16)
    listed = httpx.get(f"{server.url}/v1/responses/{response.id}/input_items?order=asc",
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    parsed = [RESPONSE_ITEM.validate_python(item) for item in listed.json()["data"]]
    assert [type(item) for item in parsed] == [
        ResponseInputMessageItem, ResponseOutputMessage, ResponseOutputMessage,
        ResponseInputMessageItem]
    assert [(part.text, part.annotations) for item in parsed[1:3] for part in item.content] \
        == [("ok", []), ("fine", [])]
    assert all(item.status == "completed" for item in parsed[1:3])


def test_input_items_or_cancels_this_server_cannot_give_are_refused(
        client: openai.OpenAI, model_id: str, server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.input_items.list("resp_nope")
    assert raised.value.code == "response_not_found"
    response = client.responses.create(model=model_id, input="x", max_output_tokens=16)
    url = f"{server.url}/v1/responses/{response.id}/input_items"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"),
                         ("order=sideways", "order"), ("after=msg_nope", "after")):
        reply = httpx.get(f"{url}?{query}", headers=headers, timeout=30)
        assert reply.status_code == 400, (query, reply.text)
        assert reply.json()["error"]["param"] == param


def test_item_references_read_as_the_stored_items_they_name(
        client: openai.OpenAI, model_id: str, server: ServerProcess) -> None:
    """An `item_reference` names an item of a stored response, input or output: the
    prompt is the one the items themselves give, and the listing shows them. An id no
    stored response has is a 404 naming the item."""
    first = client.responses.create(model=model_id, input="Remember the word apple.",
                                    max_output_tokens=16)
    (asked,) = client.responses.input_items.list(first.id).data
    (answer,) = first.output
    question = {"role": "user", "content": "Which word?"}
    sent = [{"role": "user", "content": "Remember the word apple."},
            {"role": "assistant", "content": first.output_text}, question]
    # The type may be left out, as OpenAI's ItemReference has it optional.
    referenced = [{"type": "item_reference", "id": asked.id}, {"id": answer.id}, question]
    plain = client.responses.create(model=model_id, input=sent, max_output_tokens=16,
                                    temperature=0)
    by_reference = client.responses.create(model=model_id, input=referenced,
                                           max_output_tokens=16, temperature=0)
    assert by_reference.usage.input_tokens == plain.usage.input_tokens
    assert by_reference.output_text == plain.output_text
    listed = client.responses.input_items.list(by_reference.id, order="asc").data
    assert [item.id for item in listed[:2]] == [asked.id, answer.id]
    reply = httpx.post(f"{server.url}/v1/responses", timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": model_id, "input": [
                           question, {"type": "item_reference", "id": "msg_nope"}]})
    assert reply.status_code == 404
    assert reply.json()["error"] | {"message": None} == {
        "message": None, "type": "invalid_request_error", "param": "input.1.id",
        "code": "item_not_found"}


def test_function_call_items_round_trip(client: openai.OpenAI, model_id: str) -> None:
    """A tool call and its output sent back as items, with the reasoning before them."""
    items = [
        {"role": "user", "content": "List the files."},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "I should run ls."}]},
        {"type": "function_call", "call_id": "call_1", "name": "shell",
         "arguments": '{"command": "ls"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsrc\n"},
    ]
    # Codex sends tools OpenAI runs itself, which the model is not shown, and a freeform
    # custom tool, which it is: a function of one string, its input.
    custom = {"type": "custom", "name": "apply_patch", "description": "Edit files."}
    tools = [*TOOLS, {"type": "web_search"}, custom]
    response = client.responses.create(model=model_id, input=items, tools=tools,
                                       max_output_tokens=16)
    assert [tool.name for tool in response.tools] == ["shell", "apply_patch"]
    assert response.usage.input_tokens > 20
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    items += [{"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch",
               "input": patch},
              {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Done."}]
    body = ResponsesRequest.model_validate({"model": model_id, "input": items, "tools": tools})
    *_, assistant, result = input_messages(body, [])
    assert [call["function"] for call in assistant["tool_calls"]] == [
        {"name": "apply_patch", "arguments": {"input": patch}}]
    assert (result["role"], result["content"], result["tool_call_id"]) == (
        "tool", "Done.", "call_2")
    listed = client.responses.create(model=model_id, input=items, tools=tools,
                                     max_output_tokens=16)
    assert listed.usage.input_tokens > response.usage.input_tokens
    kinds = [item.type for item in client.responses.input_items.list(listed.id, order="asc").data]
    assert kinds == ["message", "reasoning", "function_call", "function_call_output",
                     "custom_tool_call", "custom_tool_call_output"]


def test_a_run_of_assistant_text_is_one_turn_a_line_apart_as_anthropics_blocks_are() -> None:
    """Consecutive assistant message items (an agent's commentary, then its answer) are
    one assistant turn, their texts a line apart as an Anthropic turn's text blocks are;
    so is a stored response's text around a call, when a follow-up goes on from it. They
    used to be glued together ("Let me look.Done.")."""
    said = [{"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": text}]}
            for text in ("Let me look.", "Done.")]
    body = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Fix it."},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Look first."}]},
        *said]})
    _, turn = input_messages(body, [])
    assert turn == {"role": "assistant", "content": "Let me look.\nDone.",
                    "reasoning_content": "Look first."}
    (anthropic,) = chat_messages(AnthropicMessage.model_validate({
        "role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                         {"type": "text", "text": "Done."}]}))
    assert anthropic["content"] == turn["content"]
    response = ResponseObject(id="resp_1", status="completed", model="m", output=[
        OutputMessage(id="msg_1", status="completed", content=[OutputText(text="Let me look.")]),
        OutputFunctionCall(id="fc_1", call_id="call_1", name="shell", arguments="{}",
                           status="completed"),
        OutputMessage(id="msg_2", status="completed", content=[OutputText(text="Done.")])])
    assert assistant_message(response)["content"] == turn["content"]


def test_an_output_without_call_id_is_matched_by_id_or_name_or_kept_plain(
    client: openai.OpenAI, model_id: str
) -> None:
    """Codex sends its goal results with an `id`, a `name` and a `namespace` but no
    `call_id`."""
    goal = {"type": "function_call_output", "id": "goal_1", "name": "goal_objective",
            "namespace": "agent", "output": "Ship the fix."}
    call = {"type": "function_call", "call_id": "call_9", "name": "goal_objective",
            "arguments": "{}"}
    user = {"role": "user", "content": "Go on."}
    for items in ([user, goal], [user, call, goal]):
        body = ResponsesRequest.model_validate({"model": model_id, "input": items})
        result = input_messages(body, [])[-1]
        assert result["role"] == "tool" and result["content"] == "Ship the fix."
        assert result.get("tool_call_id") == ("call_9" if call in items else None)
    by_id = input_messages(ResponsesRequest.model_validate(
        {"model": model_id, "input": [{**goal, "id": "call_1", "name": None}]}),
        [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "x", "arguments": {}}}]}])
    assert by_id[-1]["tool_call_id"] == "call_1"
    response = client.responses.create(model=model_id, input=[user, call, goal, user],
                                       tools=TOOLS, max_output_tokens=16)
    assert response.status in ("completed", "incomplete")


def test_codex_shaped_agent_loop_is_served_from_cache(
    client: openai.OpenAI, model_id: str
) -> None:
    """Six steps of a Codex-shaped session: long instructions, function tools, the whole
    history resent each step (store false), a prompt_cache_key, streamed. Each step reads
    from the cache at least the whole prompt of the step before. (More where the guess of
    the next turn was prefilled in time; it gives way to other requests, so the share read
    need not grow every step.)"""
    instructions = f"You are Codex ({uuid.uuid4().hex}). " + "Work in small steps. " * 40
    key = str(uuid.uuid4())
    items: list[dict] = [{"role": "user", "content": [
        {"type": "input_text", "text": "Make the tests pass."}]}]
    prompts, cached = [], []
    for step in range(6):
        stream = client.responses.create(
            model=model_id, instructions=instructions, input=items, tools=TOOLS,
            tool_choice="auto", parallel_tool_calls=False, store=False, stream=True,
            prompt_cache_key=key, max_output_tokens=16, temperature=0.0,
        )
        final = [event for event in stream if event.type.startswith("response.")][-1].response
        assert final.prompt_cache_key == key
        usage = final.usage
        prompts.append(usage.input_tokens)
        cached.append(usage.input_tokens_details.cached_tokens)
        items += [item.model_dump(exclude_none=True) for item in final.output]
        items += [
            {"type": "function_call", "call_id": f"call_{step}", "name": "shell",
             "arguments": f'{{"command": "pytest tests/test_{step}.py"}}'},
            {"type": "function_call_output", "call_id": f"call_{step}",
             "output": f"FAILED tests/test_{step}.py::test_case - assert 1 == {step}\n" * 3},
        ]
    print("Codex-shaped (prompt, cached) tokens per step:", list(zip(prompts, cached)))
    assert cached[0] < 0.1 * prompts[0]
    assert all(read >= before for before, read in zip(prompts, cached[1:]))
    assert all(read >= 0.8 * prompt for prompt, read in zip(prompts[2:], cached[2:]))


SELF_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}


@pytest.mark.parametrize(("body", "words", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "does not read images", "input"),  # a text model
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_image", "image_url": "x"}]}]},
     "does not read images", "input"),  # a tool's screenshot, there too
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "x"},
                {"type": "custom_tool_call_output", "call_id": "c",
                 "output": [{"type": "input_image", "image_url": "x"}]}]},
     "does not read images", "input"),  # a custom tool's as a function's
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "no Files API", None),
    ({"input": "x", "background": True}, "background responses are not supported", None),
    ({"input": "x", "prompt": {"id": "pmpt_1", "variables": {"city": "Paris"}}},
     "stored prompts are not supported", None),
    ({"input": "x", "tool_choice": "required"}, "tool_choice needs tools", "tool_choice"),
    ({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"},
     "hosted tools (web_search, ...) are not run by this server", "tool_choice"),
    ({"input": "x", "tools": [{"type": "custom", "name": "p"}],
      "tool_choice": {"type": "custom", "name": "q"}}, "'q', which is not a tool",
     "tool_choice"),
    ({"input": "x", "tools": [{"type": "custom", "name": "p"}, {"type": "function",
                                                                "name": "p"}]},
     "tool names must be unique: 'p' given more than once", "tools"),
    ({"input": "x", "tools": [{"type": "custom", "name": "p",
                               "format": {"type": "grammar", "syntax": "lark"}}]},
     "needs its syntax and definition", None),
    ({"input": []}, "input is empty", None),
    ({}, "input is empty", None),
    ({"input": "x", "tools": [{"type": "function", "name": "f",
                               "parameters": {"type": "array"}}]},
     "its schema must be of type 'object', not 'array'", "tools"),
    # The path as the request spells it: no union tags ("tools.0.hosted.type").
    ({"input": "x", "tools": [{"name": "f", "parameters": {}}]}, "tools.0.type: Field required",
     "tools"),
    ({"input": [{"type": "function_call_output", "output": "x"}]},
     "input.0: function_call_output needs the call_id of the call it answers", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
     "input.0.content.0.text: Input should be a valid string", "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                        "schema": SELF_REF}}},
     "this server cannot enforce the schema: no value satisfies it", "text.format"),
    ({"input": "Go on. " * 8192, "max_output_tokens": 50},
     "leaves no room for a reply", "input"),
])
def test_bad_requests_are_openai_400s(
    server: ServerProcess, headers: dict[str, str], model_id: str, body: dict, words: str,
    param: str | None,
) -> None:
    """A 400 in OpenAI's shape, naming the Responses API's own parameter where it names
    one (text.format, not the pipeline's response_format)."""
    response = httpx.post(f"{server.url}/v1/responses", headers=headers,
                          json={"model": model_id, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"]
    if param is not None:
        assert error["param"] == param


def test_responses_endpoint_has_its_own_metric_label(
    client: openai.OpenAI, server: ServerProcess, model_id: str
) -> None:
    client.responses.create(model=model_id, input="x", max_output_tokens=16)
    text = httpx.get(f"{server.url}/metrics", headers={"x-api-key": API_KEY}).text
    assert 'endpoint="/v1/responses",status="200"' in text


# -- forced tools and structured output (the grammar's doing: the weights are random) ----


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)
    sunny: bool


WEATHER_TOOL = {"type": "function", "name": "get_weather", "strict": True,
                "description": "The forecast for a city.",
                "parameters": Weather.model_json_schema()}
ROOM = 80  # max_output_tokens: a constrained answer here is far shorter


def test_forced_function_call_round_trip(client: openai.OpenAI, model_id: str) -> None:
    called = client.responses.create(
        model=model_id, input="Weather in Paris for 3 days?", tools=[*TOOLS, WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
        max_output_tokens=ROOM,
    )
    assert called.status == "completed"
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    Weather.model_validate_json(call.arguments)
    answer = client.responses.create(
        model=model_id, previous_response_id=called.id, tools=[*TOOLS, WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 24 degrees."}],
        max_output_tokens=16,
    )
    assert [item.type for item in answer.output] == ["message"]
    assert answer.usage.input_tokens > called.usage.input_tokens + called.usage.output_tokens


def test_a_forced_custom_tool_writes_its_regular_expression(
        client: openai.OpenAI, model_id: str) -> None:
    """Random weights write a phone number only because the grammar makes them; an
    expression the grammar engine cannot take is a 400 naming the tools."""
    dial = {"type": "custom", "name": "dial", "description": "Dial a number.",
            "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{3}-[0-9]{4}"}}
    called = client.responses.create(model=model_id, input="Call home.", tools=[dial],
                                     tool_choice={"type": "custom", "name": "dial"},
                                     parallel_tool_calls=False, max_output_tokens=ROOM)
    [call] = called.output
    assert call.type == "custom_tool_call" and re.fullmatch(r"[0-9]{3}-[0-9]{4}", call.input)
    dial["format"]["definition"] = "(?=a)b"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model_id, input="Call home.", tools=[dial],
                                tool_choice={"type": "custom", "name": "dial"},
                                max_output_tokens=ROOM)
    assert refused.value.body["code"] == "unsupported_schema"
    assert refused.value.body["param"] == "tools"


def test_required_tool_call_streams_its_arguments(client: openai.OpenAI, model_id: str) -> None:
    with client.responses.stream(
        model=model_id, input="Weather?", tools=[WEATHER_TOOL], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=ROOM,
    ) as stream:
        events = list(stream)
        response = stream.get_final_response()
    kinds = [event.type for event in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas > 1
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    [call] = response.output
    assert events[-3].arguments == call.arguments
    Weather.model_validate_json(call.arguments)


def test_parse_text_format_json_schema(client: openai.OpenAI, model_id: str) -> None:
    response = client.responses.parse(model=model_id, input="Weather?", text_format=Weather,
                                      max_output_tokens=ROOM)
    assert isinstance(response.output_parsed, Weather)


def test_thinking_is_a_reasoning_item(thinking_server: ServerProcess) -> None:
    """The Qwen3-shaped template opens the thinking block; the random weights never close it,
    so the whole reply is one reasoning item, streamed as reasoning_text deltas."""
    client = openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="-", max_retries=0)
    options = {"model": "tiny-thinking", "input": "Which city is the capital?",
               "max_output_tokens": 16, "temperature": 0.0}
    whole = client.responses.create(**options)
    [item] = whole.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and whole.output_text == ""
    events = list(client.responses.create(**options, stream=True))
    deltas = [event.delta for event in events if event.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == item.content[0].text
    assert "response.output_text.delta" not in {event.type for event in events}
