"""Documents as every API attaches them (Anthropic's document and search result blocks,
Chat Completions' file parts, the Responses API's input_file parts) reach the prompt as
their text, in the
same `<document>` tags whichever API sent them; what is not text is a 400 that names it.
Each prompt is compared with the same request spelling the document out as text."""

from __future__ import annotations

import base64

import anthropic
import openai
import pytest

from server.documents import document, search_result, text_of, text_of_data_url
from tests.server.support import API_KEY, ServerProcess

NOTES = "Meeting notes\nThe launch moves to Thursday.\nBring the signed forms."
RENDERED = document(NOTES, "notes.txt")
NOTES_URL = "data:text/plain;base64," + base64.b64encode(NOTES.encode()).decode()
PDF_URL = "data:application/pdf;base64," + base64.b64encode(b"%PDF-1.4\n%%EOF").decode()
QUESTION = "When is the launch?"


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def test_a_document_is_its_text_in_tags_after_its_title_and_context():
    assert document("body", "a.txt", "from the wiki") == (
        "<document>\n<source>a.txt</source>\n<context>from the wiki</context>\n"
        "<document_content>\nbody\n</document_content>\n</document>")
    assert document("body") == "<document>\n<document_content>\nbody\n</document_content>\n</document>"


def test_text_files_are_read_and_others_refused():
    assert text_of_data_url(NOTES_URL) == NOTES
    assert text_of("text/markdown; charset=utf-8", base64.b64encode(b"# T").decode()) == "# T"
    with pytest.raises(ValueError, match="application/pdf is not read"):
        text_of_data_url(PDF_URL)
    with pytest.raises(ValueError, match="not utf-8 text"):
        text_of("text/plain", base64.b64encode(b"\xff\xfe\x00").decode())
    with pytest.raises(ValueError, match="base64 payload is invalid"):
        text_of("text/plain", "not base64!")
    with pytest.raises(ValueError, match="data: URL"):
        text_of_data_url("https://example.com/notes.txt")


def messages_prompt(claude: anthropic.Anthropic, model_id: str, blocks: list) -> int:
    return claude.messages.count_tokens(
        model=model_id, messages=[{"role": "user", "content": blocks}]).input_tokens


@pytest.mark.parametrize("source", [
    {"type": "text", "media_type": "text/plain", "data": NOTES},
    {"type": "content", "content": [{"type": "text", "text": NOTES}]},
    {"type": "content", "content": NOTES},
    {"type": "base64", "media_type": "text/plain", "data": NOTES_URL.split(",")[1]},
], ids=["text", "content-blocks", "content-string", "base64-text"])
def test_a_messages_document_is_read_as_its_text(claude, model_id, source):
    question = {"type": "text", "text": QUESTION}
    attached = messages_prompt(claude, model_id, [
        {"type": "document", "source": source, "title": "notes.txt",
         "citations": {"enabled": True}}, question])
    spelled = messages_prompt(claude, model_id, [{"type": "text", "text": RENDERED}, question])
    assert attached == spelled


def test_a_tool_result_may_hold_a_document(claude, model_id):
    def tool_turns(result: list) -> list:
        return [{"role": "user", "content": "Read the notes."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                   "name": "read", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": result}]}]
    tools = [{"name": "read", "input_schema": {"type": "object"}}]
    attached = claude.messages.count_tokens(model=model_id, tools=tools, messages=tool_turns(
        [{"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                         "data": NOTES}}]))
    spelled = claude.messages.count_tokens(model=model_id, tools=tools, messages=tool_turns(
        [{"type": "text", "text": document(NOTES)}]))
    assert attached.input_tokens == spelled.input_tokens


def test_a_search_result_is_read_as_its_text_in_a_message_and_in_a_tool_result(claude,
                                                                               model_id):
    hit = {"type": "search_result", "source": "https://wiki.example/launch",
           "title": "Launch plan", "content": [{"type": "text", "text": NOTES}],
           "citations": {"enabled": True}}
    rendered = {"type": "text", "text": search_result("https://wiki.example/launch",
                                                      "Launch plan", NOTES)}
    question = {"type": "text", "text": QUESTION}
    assert (messages_prompt(claude, model_id, [hit, question])
            == messages_prompt(claude, model_id, [rendered, question]))
    tools = [{"name": "search", "input_schema": {"type": "object"}}]

    def searched(result: dict) -> int:
        return claude.messages.count_tokens(model=model_id, tools=tools, messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "s1",
                                               "name": "search", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "s1",
                                          "content": [result]}]}]).input_tokens
    assert searched(hit) == searched(rendered)


@pytest.mark.parametrize(("source", "says"), [
    ({"type": "base64", "media_type": "application/pdf", "data": PDF_URL.split(",")[1]},
     "application/pdf is not read"),
    ({"type": "url", "url": "https://example.com/a.pdf"}, "url source is not read"),
    ({"type": "file", "file_id": "file_011"}, "file source is not read"),
    ({"type": "base64", "media_type": "text/plain", "data": "%%%"}, "base64 payload is invalid"),
])
def test_a_document_that_is_not_text_is_a_400_naming_it(claude, model_id, source, says):
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=model_id, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "document", "source": source},
                                         {"type": "text", "text": QUESTION}]}])
    assert says in refused.value.body["error"]["message"]
    assert "messages.0.content" in refused.value.body["error"]["message"]


def test_a_chat_file_part_is_read_as_its_text(client: openai.OpenAI, model_id: str):
    def prompt(part: dict) -> int:
        return client.chat.completions.create(model=model_id, max_tokens=1, messages=[
            {"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}],
        ).usage.prompt_tokens
    attached = prompt({"type": "file", "file": {"file_data": NOTES_URL,
                                                "filename": "notes.txt"}})
    assert attached == prompt({"type": "text", "text": RENDERED})
    for file, says in (({"file_data": PDF_URL}, "application/pdf is not read"),
                       ({"file_id": "file-abc"}, "no Files API")):
        with pytest.raises(openai.BadRequestError) as refused:
            prompt({"type": "file", "file": file})
        assert says in refused.value.body["message"]


def test_a_responses_input_file_is_read_as_its_text(client: openai.OpenAI, model_id: str):
    def prompt(part: dict) -> int:
        return client.responses.create(model=model_id, max_output_tokens=16, input=[
            {"role": "user", "content": [part, {"type": "input_text", "text": QUESTION}]}],
        ).usage.input_tokens
    attached = prompt({"type": "input_file", "file_data": NOTES_URL, "filename": "notes.txt"})
    assert attached == prompt({"type": "input_text", "text": RENDERED})
    for part, says in (({"type": "input_file", "file_data": PDF_URL, "filename": "a.pdf"},
                        "application/pdf is not read"),
                       ({"type": "input_file", "file_url": "https://example.com/a.pdf"},
                        "fetches no file_url")):
        with pytest.raises(openai.BadRequestError) as refused:
            prompt(part)
        assert says in refused.value.body["message"]
