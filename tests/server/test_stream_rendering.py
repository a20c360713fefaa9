"""Both agent APIs' stream renderers, fed a reply no random-weight model writes (thinking,
then text, then two tool calls) and read back by the official SDKs' own stream
accumulators, which refuse any event out of its documented order; and OpenAI's text
chunks, against their models."""

from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from engine.api import TokenEvent, TokenLogprob
from server.anthropic.adapter import MessageStream, message_response
from server.custom_tools import custom_input
from server.events import (
    ChoiceFinished,
    ChoiceResult,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallStarted,
    Usage,
    fold,
)
from server.openai.formats import ChatFormat, CompletionFormat
from server.responses.adapter import ResponseBuilder
from server.responses.protocol import CustomTool, FunctionTool, Response

REPLY = [
    ReasoningDelta(0, "The user wants "), ReasoningDelta(0, "files."),
    TextDelta(0, "Let me "), TextDelta(0, "look."),
    ToolCallStarted(0, 0, "call_a", "shell"),
    ToolCallArguments(0, 0, '{"command": '), ToolCallArguments(0, 0, '"ls"}'),
    ToolCallStarted(0, 1, "call_b", "read_file"),
    ToolCallArguments(0, 1, '{"path": "README.md"}'),
    ChoiceFinished(0, "tool_calls", Usage(prompt_tokens=120, completion_tokens=30,
                                          cached_tokens=100)),
]


def test_messages_stream_is_one_block_per_kind_in_order() -> None:
    stream = MessageStream("msg_1", "model", context_bound=False)
    events = stream.opening(prompt_tokens=120, cached_tokens=100)
    for event in REPLY:
        events += stream.event(event)
    message, buffers = None, {}
    for event in events:
        message = accumulate_event(event=json.loads(event.model_dump_json()),
                                   current_snapshot=message, json_bufs=buffers)
    assert [block.type for block in message.content] == [
        "thinking", "text", "tool_use", "tool_use"]
    assert message.content[0].thinking == "The user wants files."
    assert message.content[1].text == "Let me look."
    assert [(block.name, block.input) for block in message.content[2:]] == [
        ("shell", {"command": "ls"}), ("read_file", {"path": "README.md"})]
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens,
            message.usage.output_tokens) == (20, 100, 30)


def streamed_and_whole(reply: list) -> tuple:
    """`reply` as the Anthropic SDK reads its stream, and as a whole message."""
    stream = MessageStream("msg_1", "model", context_bound=False)
    streamed, buffers = None, {}
    for event in [*stream.opening(prompt_tokens=120, cached_tokens=100), *(e for r in reply for e in stream.event(r))]:
        streamed = accumulate_event(event=json.loads(event.model_dump_json()),
                                    current_snapshot=streamed, json_bufs=buffers)
    result = ChoiceResult()
    for event in reply:
        fold(result, event)
    return streamed, message_response("msg_1", "model", False, result)


def call_then_text(pieces: list[str]) -> list:
    """A reply of one call, its arguments written in `pieces`, then text."""
    return [ToolCallStarted(0, 0, "call_a", "get_weather"),
            *(ToolCallArguments(0, 0, piece) for piece in pieces), TextDelta(0, "So."),
            REPLY[-1]]


def test_a_whole_message_has_the_streams_blocks_in_the_order_written() -> None:
    """Text a model writes after its calls comes after them, as its stream has it, not
    merged with the text before them."""
    reply = [*REPLY[:-1], TextDelta(0, "Then "), TextDelta(0, "done."), REPLY[-1]]
    streamed, whole = streamed_and_whole(reply)
    assert [block.type for block in whole.content] == [
        "thinking", "text", "tool_use", "tool_use", "text"]
    assert [block.model_dump(exclude_none=True) for block in whole.content] == [
        block.model_dump(exclude_none=True) for block in streamed.content]


@pytest.mark.parametrize("pieces", [
    ['"Par', 'is"'], ["[1, ", "2]"], ["null"], ["  ", "Paris"], ["  ", '{"city": ', '"Rome"'],
    ["{", '"city": "Paris"}'], ["   "],
], ids=["string", "array", "null", "bare word", "object cut short", "object", "blank"])
def test_a_calls_input_streamed_is_the_one_its_message_gives(pieces: list[str]) -> None:
    """A model may write a call's arguments as something other than an object. Anthropic's
    `input` is one: the message puts such text under one key, and its stream must give the
    SDK the same input, not deltas its JSON reader refuses."""
    streamed, whole = streamed_and_whole(call_then_text(pieces))
    assert isinstance(whole.content[0].input, dict)
    assert streamed.content[0].input == whole.content[0].input
    assert streamed.content[1].text == "So."


@pytest.mark.parametrize("pieces", [
    ["{'city': ", "'Paris'}"], ['{"city": "Rome", "unit": ', "celsius}"],
    ['{"city": "Rome"', ", }"],
], ids=["python dict", "bare word", "trailing comma"])
def test_an_object_that_stops_being_json_streams_as_far_as_it_is(pieces: list[str]) -> None:
    """An object the model breaks partway (a small model's Python dict, a bare word) is
    JSON only up to the break: the SDK's reader refused the stream's deltas past it
    ("Unable to parse tool parameter JSON"), ending the stream, while the message put the
    text under one key. Both read the object as far as it is JSON."""
    streamed, whole = streamed_and_whole(call_then_text(pieces))
    assert streamed.content[0].input == whole.content[0].input
    assert whole.content[0].input == ({} if pieces[0].startswith("{'") else {"city": "Rome"})
    assert streamed.content[1].text == "So."


def test_a_long_string_argument_streams_whole_with_its_escapes() -> None:
    """The stream reads a string's text piece by piece, not the object from its start at
    every piece: escapes split across pieces, \\u ones and surrogate pairs included, still
    go out whole."""
    value = {"path": "a.py", "content": 'say "hi" \\ caf\u00e9 \U0001f30a \u0001\n' * 40}
    text = json.dumps(value)
    streamed, whole = streamed_and_whole(call_then_text(
        [text[at:at + 3] for at in range(0, len(text), 3)]))
    assert streamed.content[0].input == whole.content[0].input == value


def test_responses_stream_is_one_item_per_kind_in_order() -> None:
    builder = ResponseBuilder(Response(id="resp_1", status="in_progress", model="model"))
    events = builder.opening()
    for event in REPLY:
        events += builder.event(event)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=[], text_format=omit)
    parse = TypeAdapter(ResponseStreamEvent).validate_python
    for event in events:
        state.handle_event(parse(json.loads(event.model_dump_json())))
    assert events[-1].type == "response.completed"
    response = events[-1].response
    assert [item.type for item in response.output] == [
        "reasoning", "message", "function_call", "function_call"]
    assert response.output[0].content[0].text == "The user wants files."
    assert response.output_text == "Let me look."
    assert [(item.call_id, item.arguments) for item in response.output[2:]] == [
        ("call_a", '{"command": "ls"}'), ("call_b", '{"path": "README.md"}')]
    assert all(item.status == "completed" for item in response.output)
    assert response.usage.input_tokens_details.cached_tokens == 100
    assert builder.response == response


def test_a_reply_of_nothing_is_one_empty_message() -> None:
    """A model that ends at once still answers with an assistant message, as OpenAI's
    does, streamed in its documented order (no item at all reads as no answer)."""
    builder = ResponseBuilder(Response(id="resp_1", status="in_progress", model="model"))
    events = builder.opening() + builder.event(
        ChoiceFinished(0, "stop", Usage(prompt_tokens=12, completion_tokens=1)))
    state = ResponseStreamState(input_tools=[], text_format=omit)
    parse = TypeAdapter(ResponseStreamEvent).validate_python
    for event in events:
        state.handle_event(parse(json.loads(event.model_dump_json())))
    response = events[-1].response
    assert [(item.type, item.role, item.status) for item in response.output] == [
        ("message", "assistant", "completed")]
    assert response.output_text == "" and response.status == "completed"


def test_openai_text_chunks_are_the_chunk_models_own_json() -> None:
    # A text chunk is written into an envelope cut once per choice (server/openai/formats.py):
    # byte for byte what dumping its model gives, whatever the text holds.
    texts = [" hello", 'say "hi"\\', "line\nbreak\t\x00\x1f\x7f", "caf\u00e9 \U0001f600",
             "\x85\u2028\u2029", "</script>{}"]
    for fmt in (ChatFormat("chatcmpl-1", "m", logprobs=False),
                CompletionFormat("cmpl-1", "m", logprobs=False)):
        for exclude in (frozenset(), frozenset({"usage"})):
            for choice in (0, 2):
                for text in texts:
                    event = TextDelta(choice, text)
                    data = fmt.chunk_json(event, exclude)
                    assert data == fmt.chunk(event).model_dump_json(exclude=exclude)
                    choice_json = json.loads(data)["choices"][0]
                    assert choice_json["index"] == choice
                    assert choice_json.get("text", choice_json.get("delta", {}).get("content")) == text


def test_a_custom_tools_call_is_its_input_as_text() -> None:
    """A freeform custom tool is shown to the model as a function of one string; its call
    comes out as a custom_tool_call item whose input is that string, streamed in
    OpenAI's custom input events, beside a function call."""
    patch = '*** Begin Patch\n*** Add File: a.txt\n+"hi"\n*** End Patch'
    tools = [CustomTool(type="custom", name="apply_patch"),
             FunctionTool(type="function", name="shell")]
    builder = ResponseBuilder(Response(id="resp_1", status="in_progress", model="model",
                                       tools=tools))
    arguments = json.dumps({"input": patch})
    reply = [ToolCallStarted(0, 0, "call_a", "apply_patch"),
             *(ToolCallArguments(0, 0, arguments[at:at + 9]) for at in range(0, len(arguments), 9)),
             ToolCallStarted(0, 1, "call_c", "apply_patch"),
             ToolCallArguments(0, 1, '{"input": "again"}'),
             ToolCallStarted(0, 2, "call_b", "shell"),
             ToolCallArguments(0, 2, '{"command": "ls"}'),
             ChoiceFinished(0, "tool_calls", Usage(prompt_tokens=50, completion_tokens=40,
                                                   cached_tokens=0))]
    events = builder.opening()
    for event in reply:
        events += builder.event(event)
    state = ResponseStreamState(input_tools=[], text_format=omit)
    parse = TypeAdapter(ResponseStreamEvent).validate_python
    for event in events:
        state.handle_event(parse(json.loads(event.model_dump_json())))
    # The input streams as its string is written, a delta for each piece that adds to it.
    kinds = [event.type for event in events]
    first = events[2:kinds.index("response.output_item.done") + 1]
    deltas = first[1:-2]
    assert [event.type for event in first] == [
        "response.output_item.added", *["response.custom_tool_call_input.delta"] * len(deltas),
        "response.custom_tool_call_input.done", "response.output_item.done"]
    assert len(deltas) == len(arguments) // 9 - 1  # the opening's piece and the closing's
    assert "".join(event.delta for event in deltas) == patch
    custom, again, function = events[-1].response.output
    assert (custom.type, custom.call_id, custom.name, custom.input) == (
        "custom_tool_call", "call_a", "apply_patch", patch)
    assert (again.call_id, again.input) == ("call_c", "again")  # one custom call after another
    assert custom.id.startswith("ctc_") and custom.status == "completed"
    assert function.type == "function_call" and function.arguments == '{"command": "ls"}'
    # A call the model did not write as its one string keeps what it wrote.
    assert custom_input('{"patch": 1}') == '{"patch": 1}' and custom_input('{"inp') == '{"inp'
    # One cut off inside its string (max_output_tokens) keeps what it wrote of the string.
    assert custom_input('{"input": "*** Begin Patch\\n*** Up') == "*** Begin Patch\n*** Up"
    assert custom_input('{"input": "a\\u00e9 b\\u00') == "a\u00e9 b"
    assert custom_input('{ "input" : "x\\') == "x"


def test_legacy_text_offsets_count_an_emoji_split_across_tokens_once() -> None:
    """A token holding part of a character starts at that character: the offsets index
    the choice's text, streamed or whole (each part counted as a U+FFFD of its own, a
    reply of emoji split across tokens had offsets past its text's end)."""
    emoji = "\U0001f383\U0001f384".encode()
    pieces = [b"A", emoji[:2], emoji[2:4], emoji[4:7], emoji[7:], b" ok"]
    tokens = [TokenEvent(i, "", TokenLogprob(i, piece.decode(errors="replace"), -1.0, piece))
              for i, piece in enumerate(pieces)]
    text = b"".join(pieces).decode()
    fmt = CompletionFormat("cmpl-1", "m", logprobs=True)
    streamed = [fmt.chunk(TextDelta(0, "", tuple(tokens[at:at + 2]))) for at in (0, 2, 4)]
    whole = fmt.response([ChoiceResult(text=text, tokens=tokens, finish_reason="length")],
                         Usage()).choices[0].logprobs.text_offset
    assert whole == [o for c in streamed for o in c.choices[0].logprobs.text_offset]
    assert whole == [0, 1, 1, 2, 2, 3] and text[3:] == " ok"
