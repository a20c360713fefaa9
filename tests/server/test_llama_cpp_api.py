"""llama.cpp's native /completion, for clients written for llama.cpp's server: the same
text as OpenAI's Completions, its `completion_probabilities`, streamed `data:` events,
its grammar fields binding the text, and its counts and stop type."""

from __future__ import annotations

import json

import httpx
import pytest

from server.llama_cpp import IndentLimit
from tests.server.support import ServerProcess

PROMPT = "The three primary colours are"


def post(server: ServerProcess, headers: dict, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def test_completion_writes_what_openais_completions_write(
        server: ServerProcess, headers: dict, model_id: str) -> None:
    openai_style = post(server, headers, "/v1/completions", {
        "model": model_id, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "logprobs": 2}).json()
    native = post(server, headers, "/completion", {
        "prompt": PROMPT, "n_predict": 8, "temperature": 0, "n_probs": 2,
        "cache_prompt": True, "id_slot": -1}).json()
    assert native["content"] == openai_style["choices"][0]["text"]
    assert native["tokens_predicted"] == 8 and native["stop_type"] == "limit"
    assert native["tokens_evaluated"] == openai_style["usage"]["prompt_tokens"]
    logprobs = openai_style["choices"][0]["logprobs"]
    assert [entry["token"] for entry in native["completion_probabilities"]] == (
        logprobs["tokens"])
    for entry, top in zip(native["completion_probabilities"], logprobs["top_logprobs"]):
        assert {alt["token"]: alt["logprob"] for alt in entry["top_logprobs"]} == (
            pytest.approx(top))


def test_a_streamed_completion_is_its_whole_text_in_data_events(
        server: ServerProcess, headers: dict) -> None:
    body = {"prompt": [5, 6, 7], "n_predict": 6, "temperature": 0}
    whole = post(server, headers, "/completion", body).json()
    with httpx.stream("POST", f"{server.url}/completion", headers=headers, timeout=60,
                      json={**body, "stream": True}) as stream:
        events = [json.loads(line.removeprefix("data: ")) for line in stream.iter_lines()
                  if line.startswith("data: ")]
    assert "".join(event["content"] for event in events) == whole["content"]
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 6
    assert all(event["tokens_evaluated"] == 3 for event in events)


def test_llama_cpps_own_readings_of_its_fields(server: ServerProcess, headers: dict) -> None:
    """A negative temperature is greedy, a top_k at or below 0 is off, n_predict -2 runs
    to the context's end, and stop may be one string, as llama.cpp reads them."""
    greedy = post(server, headers, "/completion", {
        "prompt": PROMPT, "n_predict": 6, "temperature": 0}).json()
    read = post(server, headers, "/completion", {
        "prompt": PROMPT, "n_predict": 6, "temperature": -1, "top_k": -1, "stop": "\u0000"}
    ).json()
    assert read["content"] == greedy["content"]
    to_the_end = post(server, headers, "/completion", {
        "prompt": PROMPT, "n_predict": -2, "temperature": 0, "stop": greedy["content"][-3:]})
    assert to_the_end.status_code == 200 and to_the_end.json()["stop_type"] == "word"


@pytest.mark.parametrize("limit", [{"n_predict": 0}, {"max_tokens": 0}])
def test_n_predict_0_caches_the_prompt_and_writes_nothing(
        server: ServerProcess, headers: dict, limit: dict) -> None:
    """llama.cpp's documented reading: the prompt is evaluated into the cache and no token
    is generated (0 used to be dropped as unset, so the text ran to the context's end)."""
    prompt = f"{PROMPT} (warmed with {limit})"
    warmed = post(server, headers, "/completion", {"prompt": prompt, **limit}).json()
    assert (warmed["content"], warmed["tokens_predicted"]) == ("", 0)
    assert warmed["stop_type"] == "limit"
    # No earlier request had this prompt whole: its tokens are in the cache from this one.
    again = post(server, headers, "/completion", {"prompt": prompt, "n_predict": 1}).json()
    assert again["tokens_cached"] == warmed["tokens_evaluated"] - 1


def test_llama_cpps_grammar_fields_bind_the_text(server: ServerProcess, headers: dict) -> None:
    choice = post(server, headers, "/completion", {
        "prompt": PROMPT, "temperature": 0, "n_predict": 16,
        "grammar": 'root ::= "red" | "green" | "blue"'}).json()
    assert choice["content"] in ("red", "green", "blue")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    shaped = post(server, headers, "/completion", {
        "prompt": PROMPT, "temperature": 0, "n_predict": 64, "json_schema": schema}).json()
    assert isinstance(json.loads(shaped["content"])["n"], int)


def gbnf_literal(text: str) -> str:
    """A GBNF grammar whose only sentence is `text`."""
    return "root ::= " + json.dumps(text)


def streamed(server: ServerProcess, headers: dict, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/completion", headers=headers, timeout=60,
                      json={**body, "stream": True}) as stream:
        return [json.loads(line.removeprefix("data: ")) for line in stream.iter_lines()
                if line.startswith("data: ")]


def test_an_editors_completion_ends_at_a_line_indented_less_than_n_indent(
        server: ServerProcess, headers: dict) -> None:
    """llama.vscode sends the cursor line's indentation: the completion ends before the
    first character of a later line indented less, as llama.cpp cuts it."""
    code = "if x:\n    a = 1\n    b = 2\nc = 3\n"
    body = {"prompt": PROMPT, "temperature": 0, "n_predict": 64, "n_indent": 4,
            "grammar": gbnf_literal(code)}
    whole = post(server, headers, "/completion", body).json()
    assert whole["content"] == "if x:\n    a = 1\n    b = 2\n"
    assert whole["stop_type"] == "limit" and whole["tokens_predicted"] > 0
    events = streamed(server, headers, body)
    assert "".join(event["content"] for event in events) == whole["content"]
    assert events[-1]["stop"] is True and events[-1]["stop_type"] == "limit"
    assert post(server, headers, "/completion", {**body, "n_indent": 0}).json()[
        "content"] == code


@pytest.mark.parametrize(("text", "cut"), [
    ("x\n  y\n  z", None),
    ("x\n  y\n z", 7),
    ("x\n\ty", 3),  # a tab is one character of indentation
    ("x\n\n  y", 2),  # a blank line ends it, as llama.cpp's does
    ("x\n ", None),  # only indentation so far: not known yet
    (" x", None),  # the first line, the cursor's, is never judged
])
def test_the_indentation_limit_cuts_where_llama_cpp_does(text: str, cut: int | None) -> None:
    assert IndentLimit(2).feed(text) == cut
    fed = IndentLimit(2)  # the same, fed as a stream's deltas come, a character each
    assert next((at + kept for at, character in enumerate(text)
                 if (kept := fed.feed(character)) is not None), None) == cut


def test_an_editors_completion_ends_at_a_newline_after_t_max_predict_ms(
        server: ServerProcess, headers: dict) -> None:
    lines = "a\n" * 30
    body = {"prompt": PROMPT, "temperature": 0, "n_predict": 128, "t_max_predict_ms": 1,
            "grammar": gbnf_literal(lines)}
    cut = post(server, headers, "/completion", body).json()
    assert cut["stop_type"] == "limit" and cut["content"].endswith("\n")
    assert lines.startswith(cut["content"]) and len(cut["content"]) < len(lines)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 10**6]}, "prompt"),
    ({"prompt": "x", "n_probs": 21}, "n_probs"),
    ({"prompt": "x", "n_predict": -3}, "n_predict"),
    ({"prompt": "x", "n_probs": 1, "repeat_penalty": 5e-324}, "repeat_penalty"),
    ({"prompt": "x", "grammar": "root ::= x", "json_schema": {"type": "object"}}, "grammar"),
    ({"prompt": "x", "grammar": "root ::= ("}, "grammar"),
], ids=["empty", "token out of vocabulary", "n_probs", "n_predict",
        "repeat_penalty a float32 zero", "two formats",
        "bad grammar"])
def test_a_bad_completion_is_a_400_naming_its_field(
        server: ServerProcess, headers: dict, body: dict, param: str) -> None:
    response = post(server, headers, "/completion", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_props_says_the_context_window_and_slots(
        server: ServerProcess, headers: dict, model_id: str) -> None:
    props = httpx.get(f"{server.url}/props", headers=headers).json()
    limit = post(server, headers, "/tokenize", {"model": model_id, "content": "x"}).json()
    assert props["default_generation_settings"]["n_ctx"] == limit["max_model_len"]
    assert props["total_slots"] >= 1 and props["model_path"] == model_id
    assert "im_start" in props["chat_template"] and props["modalities"]["vision"] is False


@pytest.mark.parametrize("path, body", [
    ("/completion", {"prompt": PROMPT, "n_predict": 2}),
    ("/tokenize", {"content": PROMPT}),
    ("/detokenize", {"tokens": [5, 6, 7]}),
    ("/embedding", {"content": PROMPT}),
])
def test_a_body_is_json_whatever_its_content_type_says(
        server: ServerProcess, headers: dict, path: str, body: dict) -> None:
    """As llama.cpp's server reads it: `curl .../completion -d '{...}'` sends curl's
    default type, and scripts written against llama.cpp leave the header out. A web page
    on another origin posting the same (a form, or a no-cors fetch) is still refused."""
    typed = {name: value for name, value in headers.items() if name.lower() != "content-type"}
    as_form = {**typed, "Content-Type": "application/x-www-form-urlencoded"}
    for sent_as in (as_form, typed):
        answer = httpx.post(f"{server.url}{path}", content=json.dumps(body), headers=sent_as,
                            timeout=60)
        assert answer.status_code == 200, answer.text
    refused = httpx.post(f"{server.url}{path}", content=json.dumps(body), timeout=60,
                         headers={**as_form, "Origin": "https://evil.example"})
    assert refused.status_code == 403
