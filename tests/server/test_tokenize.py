"""/tokenize and /detokenize in vLLM's and llama.cpp's shapes: a chat counts what its
request's prompt_tokens will be, and ids decode back to their text."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.support import ServerProcess

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def post(server: ServerProcess, headers: dict, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["plain", "with tools"])
def test_a_chat_counts_the_prompt_tokens_its_request_reports(
        server: ServerProcess, headers: dict, client: openai.OpenAI, model_id: str,
        tools: list | None) -> None:
    counted = post(server, headers, "/tokenize",
                   {"model": model_id, "messages": CHAT, "tools": tools}).json()
    asked = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=1,
                                           **({"tools": tools} if tools else {}))
    assert counted["count"] == len(counted["tokens"]) == asked.usage.prompt_tokens
    assert counted["max_model_len"] > counted["count"]


def test_a_developer_message_is_the_system_message_of_a_template_without_the_role(
        server: ServerProcess, headers: dict, model_id: str) -> None:
    developer = [{**CHAT[0], "role": "developer"}, CHAT[1]]
    as_developer, as_system = (
        post(server, headers, "/tokenize", {"model": model_id, "messages": messages}).json()
        for messages in (developer, CHAT))
    assert as_developer["tokens"] == as_system["tokens"]


def test_text_round_trips_through_its_ids_in_both_servers_shapes(
        server: ServerProcess, headers: dict) -> None:
    text = "Hello, world! Ça va?"
    vllm = post(server, headers, "/tokenize", {"prompt": text, "return_token_strs": True,
                                               "add_special_tokens": False}).json()
    llama = post(server, headers, "/tokenize", {"content": text, "with_pieces": True}).json()
    assert [piece["id"] for piece in llama["tokens"]] == vllm["tokens"]
    # Where a piece is part of a character, llama.cpp's is its bytes (the test below).
    assert [piece["piece"] for piece in llama["tokens"] if isinstance(piece["piece"], str)] \
        == [piece for piece in vllm["token_strs"] if "\ufffd" not in piece]
    back = post(server, headers, "/detokenize", {"tokens": vllm["tokens"]}).json()
    assert back == {"prompt": text, "content": text}
    # vLLM adds the tokenizer's special tokens unless told not to; llama.cpp only if told.
    assert post(server, headers, "/tokenize", {"prompt": text}).json()["tokens"] == post(
        server, headers, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]


def test_a_piece_that_is_part_of_a_character_is_its_bytes_as_llama_cpp_gives_it(
        server: ServerProcess, headers: dict) -> None:
    """llama.cpp: "The piece field is a string if the piece is valid unicode or a list of
    bytes otherwise", so the pieces add up to the text; decoded alone, such a piece was
    U+FFFD, and which bytes it held was lost."""
    text = "é😀 ok"
    pieces = [piece["piece"] for piece in post(
        server, headers, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]]
    assert any(isinstance(piece, list) for piece in pieces), pieces
    assert b"".join(bytes(piece) if isinstance(piece, list) else piece.encode()
                    for piece in pieces) == text.encode()


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/tokenize", {}, "send exactly one of prompt, content (text) and messages"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "not prompt and messages"),
    ("/tokenize", {"messages": []}, "at least 1 item"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True},
     "continue_final_message needs add_generation_prompt to be false"),
    ("/tokenize", {"prompt": "a", "model": "no-such-model"}, "no-such-model"),
    ("/detokenize", {}, "tokens: Field required"),
    ("/detokenize", {"tokens": [10**9]}, "out of range"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
])
def test_what_cannot_be_tokenized_is_a_400(server: ServerProcess, headers: dict, path: str,
                                           body: dict, message: str) -> None:
    response = post(server, headers, path, body)
    assert response.status_code in (400, 404), response.text
    assert message in response.json()["error"]["message"]
