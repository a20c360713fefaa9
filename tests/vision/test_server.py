"""Images through every API of a real server on the demo vision model: the official SDKs
send them, the answers are mlx_vlm.generate's, a later turn with the same image is cached
past it, and each bad image is a 400 in the API's own error shape while the server goes on
serving."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
import time

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from engine.image_tokens import MARKER, text_ids
from engine.loader import load_tokenizer
from server.images import checked_image
from server.openai.adapter import chat_request
from server.openai.protocol import ChatCompletionRequest
from server.prompts import chat_prompt
from tests.server.support import start_server, wait_idle
from tests.vision.support import (
    QUESTION,
    VlmReference,
    data_url,
    image_count,
    png,
    prompt_text,
    webp_hiding_a_photocd,
)

MAX_TOKENS = 16  # the least max_output_tokens the Responses API takes, as OpenAI's
MAX_PIXELS = 1_000_000


@pytest.fixture(scope="module")
def vision_server(demo_vlm_dir, tmp_path_factory):
    process = start_server(demo_vlm_dir, tmp_path_factory.mktemp("vision") / "server.log",
                           "--max-image-pixels", str(MAX_PIXELS),
                           "--max-images-per-request", "2",
                           "--allow-image-urls", "127.0.0.1")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(vision_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vision_server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(demo_vlm_dir):
    return load_tokenizer(demo_vlm_dir)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def chat_text(tokenizer) -> list[dict]:
    """The chat of an image then QUESTION, their parts a line apart as every API joins
    them."""
    return [{"role": "user", "content": f"{MARKER}\n{QUESTION}"}]


def expected_answer(tokenizer, reference, image: bytes) -> str:
    """mlx_vlm.generate's greedy answer to `chat_text` with `image`."""
    tokens = tokenizer.chat_prompt(chat_text(tokenizer),
                                   image_counts=[image_count(tokenizer, image)])
    answer = reference.greedy(prompt_text(tokenizer, tokens), [image], MAX_TOKENS)
    ends = tokenizer.eos_token_ids
    return tokenizer.decode(skip_special_tokens=True, tokens=[t for t in answer[:next(
        (i for i, t in enumerate(answer) if t in ends), len(answer))]])


def chat_image(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def test_the_openai_sdk_sends_an_image_and_a_second_turn_is_cached_past_it(
        vision_server, client, model, tokenizer, reference):
    image = png(11)
    first = client.chat.completions.create(model=model, messages=chat_image(data_url(image)),
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert first.choices[0].message.content == expected_answer(tokenizer, reference, image)

    turns = [*chat_image(data_url(image)),
             {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Tell me more."}]
    second = client.chat.completions.create(model=model, messages=turns,
                                            max_tokens=MAX_TOKENS, temperature=0)
    swapped = [*chat_image(data_url(png(12))), *turns[1:]]
    other = client.chat.completions.create(model=model, messages=swapped,
                                           max_tokens=MAX_TOKENS, temperature=0)

    image_end = first.usage.prompt_tokens - len(tokenizer.encode(
        f"\n\n{QUESTION}<end_of_turn>\n<start_of_turn>model\n", special_tokens=False))
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens > image_end
    assert other.usage.prompt_tokens_details.cached_tokens < image_end - 16
    assert vision_server.metrics()["radix_mlx_engine_images_encoded_total"] >= 2


def test_an_image_chats_next_turn_is_cached_up_to_its_own_text(
        vision_server, client, model, tokenizer):
    """The reply, as the template renders it back after the image, is prefilled once it
    is done (server/next_turn.py): only the new question is computed."""
    image = png(13)
    wait_idle(vision_server)  # an earlier reply's guess, ending now, would count as this one's
    before = vision_server.metrics()["radix_mlx_next_turn_prefilled_tokens_total"]
    first = client.chat.completions.create(model=model, messages=chat_image(data_url(image)),
                                           max_tokens=MAX_TOKENS, temperature=0)
    deadline = time.monotonic() + 10
    while (vision_server.metrics()["radix_mlx_next_turn_prefilled_tokens_total"] == before
           and time.monotonic() < deadline):
        time.sleep(0.05)
    turns = [*chat_image(data_url(image)),
             {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Tell me more."}]
    second = client.chat.completions.create(model=model, messages=turns,
                                            max_tokens=MAX_TOKENS, temperature=0)
    own = len(tokenizer.encode("Tell me more.<end_of_turn>\n<start_of_turn>model\n",
                               special_tokens=False))
    assert second.usage.prompt_tokens_details.cached_tokens >= (
        second.usage.prompt_tokens - own - 2)


def test_a_qwen_vl_server_sizes_each_image_and_caches_past_it(demo_qwen_vl_dir, tmp_path):
    """Qwen2.5-VL: each image gets as many tokens as its size makes, counted by the server
    before the prompt is built; the answers are mlx_vlm.generate's, and a second turn
    reuses the KV past the image."""
    tokenizer, reference = load_tokenizer(demo_qwen_vl_dir), VlmReference(demo_qwen_vl_dir)
    wide, square = png(17, size=(20, 64)), png(18, size=(16, 16))
    process = start_server(demo_qwen_vl_dir, tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{process.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        answers = [client.chat.completions.create(
            model=model, messages=chat_image(data_url(image)), max_tokens=MAX_TOKENS,
            temperature=0) for image in (wide, square)]
        turns = [*chat_image(data_url(wide)),
                 {"role": "assistant", "content": answers[0].choices[0].message.content},
                 {"role": "user", "content": "Tell me more."}]
        second = client.chat.completions.create(model=model, messages=turns,
                                                max_tokens=MAX_TOKENS, temperature=0)
        # Qwen's processor takes no side under 1/200 of the other: a 400, and it goes on.
        sliver = httpx.post(f"{process.url}/v1/chat/completions", timeout=60, json={
            "model": model, "messages": chat_image(data_url(png(19, size=(600, 2))))})
        assert sliver.status_code == 400, sliver.text
        assert sliver.json()["error"]["code"] == "invalid_image"
        assert "image 1" in sliver.json()["error"]["message"]
        assert client.chat.completions.create(model=model, messages=chat_image(
            data_url(square)), max_tokens=1).choices[0].message.content is not None
    finally:
        process.stop()
    counts = [image_count(tokenizer, image) for image in (wide, square)]
    assert counts[0] != counts[1]
    for image, count, answer in zip((wide, square), counts, answers):
        assert answer.choices[0].message.content == expected_answer(tokenizer, reference, image)
        assert answer.usage.prompt_tokens == len(tokenizer.chat_prompt(
            chat_text(tokenizer), image_counts=[count]))
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= answers[0].usage.prompt_tokens - 1


def test_the_anthropic_sdk_sends_a_base64_image(vision_server, model, tokenizer, reference):
    image = png(13)
    client = anthropic.Anthropic(base_url=vision_server.url, api_key="none", max_retries=0)
    message = client.messages.create(
        model=model, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data_url(image).split(",", 1)[1]}},
            {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == expected_answer(tokenizer, reference, image)


def test_the_responses_api_takes_an_input_image(client, model, tokenizer, reference):
    image = png(14)
    response = client.responses.create(
        model=model, max_output_tokens=MAX_TOKENS, temperature=0,
        input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(image)},
            {"type": "input_text", "text": QUESTION}]}])
    again = client.responses.create(
        model=model, max_output_tokens=MAX_TOKENS, temperature=0,
        previous_response_id=response.id, input="Tell me more.")
    # The previous turns' image came back from the stored conversation, and was cached.
    assert response.output_text == expected_answer(tokenizer, reference, image)
    assert again.usage.input_tokens_details.cached_tokens >= response.usage.input_tokens - 1


def test_a_tools_image_output_is_read_as_in_a_chat_tool_message(vision_server, client, model):
    """A tool's image output (a screenshot) is the model's to see in every API, as in
    Chat's tool message: the same prompt and answer. (Responses dropped it and left its
    marker in the text; Messages refused image blocks in a tool_result.)"""
    url = data_url(png(16))
    call = {"id": "c", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    chat = client.chat.completions.create(model=model, max_tokens=MAX_TOKENS, temperature=0,
                                          messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c",
         "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    response = client.responses.create(model=model, max_output_tokens=MAX_TOKENS,
                                       temperature=0, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": "c", "name": "look", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c",  # as Codex's view_image sends it
         "output": [{"type": "input_image", "image_url": url, "detail": "original"}]}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content
    claude = anthropic.Anthropic(base_url=vision_server.url, api_key="none", max_retries=0)
    message = claude.messages.create(model=model, max_tokens=MAX_TOKENS,
                                     extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c", "name": "look",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": url.split(",", 1)[1]}}]}]}])
    usage = message.usage  # Anthropic's input_tokens are the ones not read from cache
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert message.content[0].text == chat.choices[0].message.content


def test_a_custom_tools_image_output_is_read_where_it_is_as_in_chat(
        vision_server, client, model):
    """A custom tool's image output is loaded as a function's is: Chat's prompt and answer
    for the same turns, a later user image in its own place, a bad image a 400. (It was
    never loaded: its marker stood with no image, a later user image was fed there.)"""
    tool, later = data_url(png(16)), data_url(png(17))
    call = {"id": "c", "type": "custom", "custom": {"name": "look", "input": "screen"}}
    chat = client.chat.completions.create(
        model=model, max_tokens=MAX_TOKENS, temperature=0,
        tools=[{"type": "custom", "custom": {"name": "look"}}], messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c",
             "content": [{"type": "image_url", "image_url": {"url": tool}}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": later}}]}])

    def respond(url: str) -> httpx.Response:
        return httpx.post(f"{vision_server.url}/v1/responses", timeout=60, json={
            "model": model, "max_output_tokens": MAX_TOKENS, "temperature": 0,
            "tools": [{"type": "custom", "name": "look"}], "input": [
                {"role": "user", "content": QUESTION},
                {"type": "custom_tool_call", "call_id": "c", "name": "look", "input": "screen"},
                {"type": "custom_tool_call_output", "call_id": "c",
                 "output": [{"type": "input_image", "image_url": url}]},
                {"role": "user", "content": [{"type": "input_image", "image_url": later}]}]})

    response = respond(tool).json()
    assert response["usage"]["input_tokens"] == chat.usage.prompt_tokens
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])
    assert text == chat.choices[0].message.content
    for bad in (BAD_IMAGES["invalid base64"], BAD_IMAGES["a file URL"]):
        refused = respond(bad)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "invalid_image"


def test_an_image_in_an_assistant_message_is_a_400_in_each_api(vision_server, model):
    """A model's own turn is text: each API refuses an image there alike (Responses took
    its marker into the text and never loaded the image)."""
    url = data_url(png(16))
    chat = httpx.post(f"{vision_server.url}/v1/chat/completions", timeout=30, json={
        "model": model, "max_tokens": 4, "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": url}}]},
            {"role": "user", "content": "And?"}]})
    responses = httpx.post(f"{vision_server.url}/v1/responses", timeout=30, json={
        "model": model, "max_output_tokens": 16, "input": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "input_image", "image_url": url}]},
            {"role": "user", "content": "And?"}]})
    assert (chat.status_code, responses.status_code) == (400, 400), responses.text
    assert "assistant" in responses.json()["error"]["message"]


def test_tokenize_gives_a_chat_with_an_image_in_the_models_own_token_ids(
        vision_server, model, tokenizer):
    """As vLLM's /tokenize: the image is its image token, repeated as the model reads it,
    and each id has its piece (the radix cache's image keys, past the vocabulary, came out
    instead, and decoding them for pieces was a 500)."""
    image = png(16)
    expected = tokenizer.chat_prompt(chat_text(tokenizer),
                                     image_counts=[image_count(tokenizer, image)])
    counted = httpx.post(f"{vision_server.url}/tokenize", timeout=30, json={
        "model": model, "messages": chat_image(data_url(image)), "return_token_strs": True,
        "with_pieces": True}).json()
    assert [piece["id"] for piece in counted["tokens"]] == expected
    assert counted["token_strs"] == [tokenizer.decode([token]) for token in expected]
    assert expected.count(tokenizer.images.image_token_id) == image_count(tokenizer, image)


def test_a_warm_prompt_with_an_image_is_cached_past_its_image(demo_vlm_dir, tmp_path):
    """--warm-prompts loads a chat's images as its request does, so the first real request
    finds all of it cached (the image was left out: only the text before it was)."""
    messages = [{"role": "system", "content": "You are a screenshot analyst. " * 30},
                *chat_image(data_url(png(18)))]
    warm = tmp_path / "warm.jsonl"
    warm.write_text(json.dumps({"messages": messages}) + "\n")
    server = start_server(demo_vlm_dir, tmp_path / "server.log", "--warm-prompts", str(warm))
    try:
        deadline = time.monotonic() + 60
        while "warm prompts:" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        usage = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 1}).json()["usage"]
    finally:
        server.stop()
    assert "warm prompts: 1 prefilled" in server.log()
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1


def test_an_object_replacement_character_in_text_is_text(tokenizer, client, model):
    """U+FFFC stands where rich-text editors had an attachment, so pasted text holds it:
    it is the user's text, not an image's place (as the image marker once, it left a
    stray image token in a text chat, or moved an image to where the user's character
    was)."""
    pasted = "See the file \ufffc here."
    for images in ((), (png(16),)):
        content = [{"type": "text", "text": pasted}] + [
            {"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
        chat = ChatCompletionRequest.model_validate(
            {"model": model, "messages": [{"role": "user", "content": content}]})
        request = chat_request(chat)
        files = [checked_image(image, 10**8, tokenizer.images.settings) for image in images]
        prompt = chat_prompt(tokenizer, request, images=files)
        text = tokenizer.decode(text_ids(prompt.tokens))
        assert pasted in text and len(prompt.images) == len(images)
        assert client.chat.completions.create(
            model=model, max_tokens=2, messages=[{"role": "user", "content": content}]).choices


def test_image_tokens_written_as_text_in_a_text_chat_are_text(tokenizer, client, model):
    """A coding agent pastes a vision model's source, which names its image tokens: with
    no image in the chat, they are tokens of its text, as on the language model (they were
    counted as images, and the chat refused for holding more images than it sent)."""
    images = tokenizer.images
    pasted = f"The processor writes {images.placeholder} then {images.image * 3}."
    reply = client.chat.completions.create(
        model=model, max_tokens=2, messages=[{"role": "user", "content": pasted}])
    assert reply.choices[0].finish_reason == "length"


def test_an_image_placeholder_typed_beside_an_image_places_no_image(
        vision_server, tokenizer, client, model):
    """The model's placeholder typed as text (a web page a tool fetched, a pasted
    template) took the attached image's place: the text before the attachment decided
    where the image went. It is text; the image goes where it was attached."""
    images = tokenizer.images
    typed = f"AAA {images.placeholder} BBB"
    content = [{"type": "text", "text": typed},
               {"type": "image_url", "image_url": {"url": data_url(png(3))}}]
    tokens = [piece["id"] for piece in httpx.post(
        f"{vision_server.url}/tokenize", timeout=30, json={
            "model": model, "messages": [{"role": "user", "content": content}],
            "with_pieces": True}).json()["tokens"]]
    first_image = tokens.index(images.image_token_id)
    assert "BBB" in tokenizer.decode(tokens[:first_image])  # the image after the text
    assert tokens.count(images.image_token_id) == image_count(tokenizer, png(3))
    reply = client.chat.completions.create(
        model=model, max_tokens=2, messages=[{"role": "user", "content": content}])
    assert reply.choices[0].finish_reason == "length"


def test_the_mark_of_an_images_place_typed_as_text_is_refused(client, model):
    """A client's text holding the pair the front ends write where an image goes took an
    attached image's place: the image's tokens went into an earlier message's text."""
    typed = [{"role": "user", "content": f"Look: {MARKER} there."},
             {"role": "assistant", "content": "Where?"},
             {"role": "user", "content": [
                 {"type": "text", "text": "Here."},
                 {"type": "image_url", "image_url": {"url": data_url(png(3))}}]}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, max_tokens=2, messages=typed)
    assert refused.value.code == "invalid_image"


def test_an_image_url_is_fetched_from_an_allowed_host(client, model, tokenizer, reference):
    image = png(15)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(image)

        def log_message(self, *args):
            pass

    host = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{host.server_port}/picture.png"
        reply = client.chat.completions.create(model=model, messages=chat_image(url),
                                               max_tokens=MAX_TOKENS, temperature=0)
    finally:
        host.shutdown()
    assert reply.choices[0].message.content == expected_answer(tokenizer, reference, image)


def test_a_file_read_two_ways_is_fed_as_the_image_it_was_keyed_as(
        client, model, tokenizer, reference):
    """Two WebPs of one picture, each hiding another PhotoCD picture that a reader of
    every format decodes instead: the server keyed both on their WebP, and the model was
    fed the PhotoCD, so the second reused the first one's KV for another picture. Each
    is now its WebP to both: the answer is the WebP's, and the second is cached."""
    picture = Image.new("RGB", (32, 32), (30, 120, 200))
    picture.paste((250, 20, 20), (4, 4, 20, 12))
    webp = io.BytesIO()
    picture.save(webp, format="WEBP", lossless=True)
    expected = expected_answer(tokenizer, reference, webp.getvalue())
    replies = [client.chat.completions.create(
        model=model, messages=chat_image(data_url(webp_hiding_a_photocd(picture, shade),
                                                  "image/webp")),
        max_tokens=MAX_TOKENS, temperature=0) for shade in (0x10, 0xE0)]
    assert [reply.choices[0].message.content for reply in replies] == [expected, expected]
    assert replies[1].usage.prompt_tokens_details.cached_tokens >= (
        replies[1].usage.prompt_tokens - 1)


def truncated_png() -> bytes:
    data = png(16)
    return data[:len(data) // 2]


def bomb_png() -> bytes:
    out = io.BytesIO()
    Image.new("L", (2000, 2000)).save(out, format="PNG")  # 4M pixels in a few kB
    return out.getvalue()


BAD_IMAGES = {
    "invalid base64": "data:image/png;base64,not*base64!",
    "not an image": data_url(b"just some text, no pixels", "image/png"),
    "a truncated PNG": data_url(truncated_png()),
    "a decompression bomb": data_url(bomb_png()),
    "a file path": "/etc/passwd",
    "a file URL": "file:///etc/passwd",
    "a host not allowed": "http://localhost:1/picture.png",
    "an allowed host's URL no client can open": "http://127.0.0.1:99999/picture.png",
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_a_bad_image_is_a_400_in_each_apis_shape_and_the_server_goes_on(
        vision_server, client, model, case):
    url = BAD_IMAGES[case]
    chat = httpx.post(f"{vision_server.url}/v1/chat/completions", timeout=30, json={
        "model": model, "max_tokens": 4, "messages": chat_image(url)})
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["code"] == "invalid_image"

    responses = httpx.post(f"{vision_server.url}/v1/responses", timeout=30, json={
        "model": model, "max_output_tokens": 16, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url}]}]})
    assert responses.status_code == 400, responses.text
    assert responses.json()["error"]["code"] == "invalid_image"

    source = ({"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}
              if url.startswith("data:") else {"type": "url", "url": url})
    messages = httpx.post(f"{vision_server.url}/v1/messages", timeout=30, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": source}, {"type": "text", "text": "Hi"}]}]})
    assert messages.status_code == 400, messages.text
    assert messages.json()["type"] == "error"
    assert messages.json()["error"]["type"] == "invalid_request_error"

    alive = client.chat.completions.create(model=model, max_tokens=2,
                                           messages=[{"role": "user", "content": "Hi"}])
    assert alive.choices[0].finish_reason in ("stop", "length")


def test_base64_without_its_data_url_is_a_400_that_shows_the_form(vision_server, model):
    """Some clients send an image_url's base64 alone, as Ollama's images are: the error
    says what the URL should look like (it said images came as "data: URLs or base64")."""
    raw = data_url(png(3)).split(",", 1)[1]
    reply = httpx.post(f"{vision_server.url}/v1/chat/completions", timeout=30, json={
        "model": model, "max_tokens": 4, "messages": chat_image(raw)})
    assert reply.status_code == 400
    assert "data:image/png;base64," in reply.json()["error"]["message"]


def test_more_images_than_the_limit_are_a_400(vision_server, model):
    parts = [{"type": "image_url", "image_url": {"url": data_url(png(seed))}}
             for seed in range(3)]
    reply = httpx.post(f"{vision_server.url}/v1/chat/completions", timeout=30, json={
        "model": model, "max_tokens": 4,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Hi"}]}]})
    assert reply.status_code == 400
    assert "3 images exceed" in reply.json()["error"]["message"]



def test_ollamas_raw_prompt_places_its_images_with_their_img_tags(
        vision_server, model, tokenizer):
    """Ollama's /api/generate with `raw` sends its images along, each where the prompt's
    [img-N] tag (N: its index in `images`) is, as its runner places them; an image whose
    tag the prompt lacks is a 400, as llama-server's count of markers makes it. The raw
    prompt of a chat's text answers as the chat does. Raw with images was a 400."""
    images = [base64.b64encode(png(seed)).decode() for seed in (4, 5)]
    options = {"temperature": 0, "num_predict": 6}
    chat = [{"role": "user", "content": f"{QUESTION} Then this one.", "images": images}]
    chatted = httpx.post(f"{vision_server.url}/api/chat", timeout=60, json={
        "model": model, "messages": chat, "stream": False, "options": options}).json()
    # The chat's text as its template writes it, the images' placeholders as Ollama's
    # tags, in the order the images come in the prompt (not that of `images`).
    placeholder = tokenizer.images.placeholder
    text = tokenizer._wrapper.apply_chat_template(
        [{"role": "user", "content": f"{placeholder}{placeholder}{QUESTION} Then this one."}],
        tokenize=False, add_generation_prompt=True)
    bos = tokenizer.decode(tokenizer.encode("")) if tokenizer.encode("") else ""
    text = text.removeprefix(bos).replace(placeholder, "[img-1]", 1).replace(
        placeholder, "[img-0]", 1)

    def generate(prompt: str, sent: list[str]) -> httpx.Response:
        return httpx.post(f"{vision_server.url}/api/generate", timeout=60, json={
            "model": model, "prompt": prompt, "raw": True, "images": sent, "stream": False,
            "options": options})

    raw = generate(text, images[::-1])
    assert raw.status_code == 200, raw.text
    assert raw.json()["response"] == chatted["message"]["content"]
    assert raw.json()["prompt_eval_count"] == chatted["prompt_eval_count"]
    untagged = generate(text.replace("[img-1]", ""), images)
    assert untagged.status_code == 400
    assert "[img-1]" in untagged.json()["error"]
