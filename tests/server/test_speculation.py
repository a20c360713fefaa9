"""Speculative decoding through the server: a request turns it on with its `speculation`
field, and /metrics and the access log say how its drafts did."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.support import ALIAS, API_KEY, ServerProcess

MESSAGES = [{"role": "user", "content": "Repeat after me: the quick brown fox jumps."}]


def chat(server: ServerProcess, request_id: str, **extra):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    return client.chat.completions.create(
        model=ALIAS, messages=MESSAGES, max_tokens=24, temperature=0,
        extra_headers={"x-request-id": request_id}, extra_body=extra)


def test_a_request_turns_speculation_on_and_its_answer_is_unchanged(server):
    """The server's default is off; the repeated request is drafted from the radix tree
    (what the first one generated after the same prompt), every draft token accepted."""
    before = server.metrics()
    plain = chat(server, "spec-plain")
    drafted = chat(server, "spec-drafted", speculation="on")
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    after = server.metrics()
    accepted = (after["radix_mlx_speculative_accepted_tokens_total"]
                - before.get("radix_mlx_speculative_accepted_tokens_total", 0))
    assert accepted > 0
    assert (after["radix_mlx_speculative_draft_tokens_total"]
            - before.get("radix_mlx_speculative_draft_tokens_total", 0)) == accepted
    assert "accept=1.00 tok/step=" in server.access_line("spec-drafted")
    assert "accept=- tok/step=-" in server.access_line("spec-plain")


def test_an_unknown_mode_is_a_400(server):
    with pytest.raises(openai.BadRequestError):
        chat(server, "spec-bad", speculation="always")


def test_the_messages_and_responses_apis_take_the_field_too(server):
    headers = {"x-api-key": API_KEY, "x-request-id": "spec-messages"}
    messages = httpx.post(f"{server.url}/v1/messages", headers=headers, timeout=60, json={
        "model": ALIAS, "max_tokens": 24, "temperature": 0, "messages": MESSAGES,
        "speculation": "on"})
    assert messages.status_code == 200, messages.text
    headers["x-request-id"] = "spec-responses"
    responses = httpx.post(f"{server.url}/v1/responses", headers=headers, timeout=60, json={
        "model": ALIAS, "max_output_tokens": 24, "temperature": 0,
        "input": MESSAGES[0]["content"], "speculation": "auto"})
    assert responses.status_code == 200, responses.text
    assert "tok/step=" in server.access_line("spec-messages")


FILE = "".join(f"def handler_{i}(request):\n    value = request.get('field_{i}')\n"
               f"    if value is None:\n        return error('missing field_{i}')\n"
               f"    return ok(value * {i})\n\n" for i in range(3))
EDIT = [{"role": "user", "content": f"Here is a file:\n```python\n{FILE}```\nRepeat the whole "
         "file exactly, but rename handler_1 to handle_one. Output only the code."}]


def test_a_prediction_drafts_the_answer_and_usage_counts_it(real_client: openai.OpenAI):
    """OpenAI's Predicted Outputs, on the real default model with the server's
    speculation off: the file asked back with an edit is the prediction, the answer is
    the one without it, and usage says how much of the prediction the answer kept,
    streamed and whole alike."""
    asked = {"model": real_client.models.list().data[0].id, "messages": EDIT,
             "max_tokens": 64, "temperature": 0}
    plain = real_client.chat.completions.create(**asked)
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    predicted = real_client.chat.completions.create(
        **asked, prediction={"type": "content", "content": FILE})
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 32
    assert details.accepted_prediction_tokens > details.rejected_prediction_tokens
    stream = real_client.chat.completions.create(
        **asked, stream=True, stream_options={"include_usage": True},
        prediction={"type": "content", "content": [{"type": "text", "text": FILE}]})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 32


@pytest.mark.parametrize("prediction", [{"type": "content", "content": 5},
                                        {"type": "file", "content": "x"},
                                        {"type": "content", "content": [{"type": "image"}]}])
def test_a_malformed_prediction_is_a_400(real_client: openai.OpenAI, prediction):
    with pytest.raises(openai.BadRequestError) as refused:
        real_client.chat.completions.create(
            model=real_client.models.list().data[0].id, messages=EDIT, max_tokens=4,
            prediction=prediction)
    assert refused.value.body["param"].startswith("prediction")
