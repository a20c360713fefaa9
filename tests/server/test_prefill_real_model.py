"""/v1/classify, /v1/rerank and /v1/embeddings on the real default model (SmolLM2-135M-
Instruct), against a direct mlx-lm forward over the same directory: classify's tokens and
logprobs, the judge's yes/no probabilities, last-token embeddings, and the radix cache
sharing an embedding instruction across requests."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import httpx
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from tokenizers import Tokenizer, processors

from engine.tokenizer import trailing_specials
from server.openai.protocol import PROMPT_SHAPES
from server.prefill.routes import (
    GROUP_TOKENS,
    JUDGE_INSTRUCTION,
    JUDGE_SYSTEM,
    _truncated,
    judge_score,
)
from tests.server.support import API_KEY, ServerProcess, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SENTENCES = ["The capital of France is", "I loved this film, it was", "2 + 2 =",
             "The opposite of hot is"]
LOGPROB_TOLERANCE = 2e-3  # a padded batch's forward against one prompt's alone


@pytest.fixture(scope="module")
def reference(real_model_dir: Path):
    model, tokenizer = mlx_lm.load(str(real_model_dir))
    return model, tokenizer


def last_logprobs(model, tokens: list[int]) -> np.ndarray:
    logits = model(mx.array([tokens]))[0, -1].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits))


def post(server: ServerProcess, path: str, body: dict, request_id: str = "") -> dict:
    headers = {**AUTH, **({"x-request-id": request_id} if request_id else {})}
    response = httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def label_logprob(model, prompt: list[int], label: list[int]) -> float:
    """A label's logprob after `prompt`: its tokens' logprobs in sequence (one causal
    forward of both gives each at its position)."""
    logits = model(mx.array([prompt + label]))[0, len(prompt) - 1:-1].astype(mx.float32)
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return float(sum(logprobs[i, token] for i, token in enumerate(label)))


def test_classify_equals_mlx_lm(real_server: ServerProcess, reference) -> None:
    """The token at each prompt's last position, its logprob and the top 5 are mlx-lm's;
    a label of several tokens scores as the sum of its tokens' logprobs in sequence."""
    model, tokenizer = reference
    prompts = [tokenizer.encode(text) for text in SENTENCES]
    labels = [" Paris is", " cold", " a very good one"]
    label_tokens = [tokenizer.encode(label, add_special_tokens=False) for label in labels]
    assert [len(tokens) for tokens in label_tokens] == [2, 1, 4]
    body = post(real_server, "/v1/classify", {"input": SENTENCES, "top_logprobs": 5,
                                              "labels": labels})
    assert body["object"] == "list" and len(body["data"]) == len(SENTENCES)
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    for item, tokens in zip(body["data"], prompts):
        expected = last_logprobs(model, tokens)
        top = np.argsort(-expected)[:5].tolist()
        assert item["token_id"] == top[0]
        assert item["token"] == tokenizer.decode([top[0]])
        assert abs(item["logprob"] - expected[top[0]]) < LOGPROB_TOLERANCE
        assert [t["token_id"] for t in item["top_logprobs"]] == top
        for label, ids in zip(labels, label_tokens):
            assert abs(item["labels"][label] - label_logprob(model, tokens, ids)) \
                < len(ids) * LOGPROB_TOLERANCE
    paris = body["data"][0]
    assert paris["labels"][" Paris is"] > paris["labels"][" cold"]


def test_many_labels_score_as_each_alone(real_server: ServerProcess, reference) -> None:
    """Long labels with more distinct later tokens than one group reads (so in two
    groups, each over more than one job): every label's score is still its own tokens'
    logprobs in sequence."""
    model, tokenizer = reference
    words = [w for w in (tokenizer.decode([i]) for i in range(2000, 3000))
             if w.startswith(" ") and w[1:].isalpha()]
    labels = ["".join(words[k * 25:(k + 1) * 25]) for k in range(3)]
    label_tokens = {label: tokenizer.encode(label, add_special_tokens=False)
                    for label in labels}
    assert len({t for tokens in label_tokens.values() for t in tokens[1:]}) > GROUP_TOKENS
    inputs = SENTENCES[:1]
    body = post(real_server, "/v1/classify", {"input": inputs, "labels": labels})
    for item, text in zip(body["data"], inputs):
        prompt = tokenizer.encode(text)
        for label, tokens in label_tokens.items():
            assert abs(item["labels"][label] - label_logprob(model, prompt, tokens)) \
                < len(tokens) * LOGPROB_TOLERANCE


def test_classify_takes_chats_and_token_ids(real_server: ServerProcess, reference) -> None:
    model, tokenizer = reference
    chat = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    tokens = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    by_chat = post(real_server, "/v1/classify", {"messages": [chat]})["data"][0]
    by_ids = post(real_server, "/v1/classify", {"input": [tokens]})["data"][0]
    expected = last_logprobs(model, tokens)
    assert by_chat["token_id"] == by_ids["token_id"] == int(np.argmax(expected))
    assert abs(by_chat["logprob"] - expected.max()) < LOGPROB_TOLERANCE
    mixed = post(real_server, "/v1/classify", {"input": [SENTENCES[0], tokens]})["data"]
    assert [item["token_id"] for item in mixed] == [
        int(np.argmax(last_logprobs(model, tokenizer.encode(SENTENCES[0])))),
        by_ids["token_id"]]


def test_completions_with_max_tokens_1_still_answer(real_server: ServerProcess) -> None:
    body = post(real_server, "/v1/completions", {"prompt": SENTENCES[:2], "max_tokens": 1,
                                                 "temperature": 0})
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]


def test_a_classify_list_keeps_only_what_its_prompts_share(real_server: ServerProcess,
                                                           reference) -> None:
    """The list's common instruction is computed once and cached; each review after it
    is read once and not kept: asked again alone, a review finds the instruction cached
    and nothing more, with the same answer."""
    _, tokenizer = reference
    instruction = "Is the following review positive or negative? Review: "
    texts = [instruction + review for review in
             ("a quiet triumph of a film", "two hours I will never get back", "fine.")]
    prompts = [tokenizer.encode(text) for text in texts]
    shared = next(i for i, column in enumerate(zip(*prompts)) if len(set(column)) > 1)
    listed = post(real_server, "/v1/classify", {"input": texts})
    assert listed["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * shared
    alone = post(real_server, "/v1/classify", {"input": texts[:1]})
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
    assert alone["data"][0]["token_id"] == listed["data"][0]["token_id"]
    assert abs(alone["data"][0]["logprob"] - listed["data"][0]["logprob"]) < LOGPROB_TOLERANCE


def test_lists_whose_clients_leave_change_no_other_lists_answers(real_server: ServerProcess,
                                                                 reference) -> None:
    """Eight lists sharing one new instruction sent at once, every other client leaving
    as soon as it has sent its list: one prompt computes the instruction for all of them,
    and whether or not its client stayed, the lists that stay answer as mlx-lm does and
    the server is left running nothing and pinning nothing."""
    model, tokenizer = reference
    instruction = "Answer with one word: which animal is described here? "
    lists = [[f"{instruction}It says {sound} and has {legs} legs." for sound in
              ("moo", "woof", "meow")] for legs in range(8)]

    async def send(client: httpx.AsyncClient, texts: list[str], leaves: bool) -> dict | None:
        request = client.post("/v1/classify", json={"input": texts, "top_logprobs": 2})
        if not leaves:
            response = await request
            assert response.status_code == 200, response.text
            return response.json()
        task = asyncio.ensure_future(request)
        await asyncio.sleep(0.01)
        task.cancel()
        return None

    async def everyone() -> list[dict | None]:
        async with httpx.AsyncClient(base_url=real_server.url, headers=AUTH,
                                     timeout=300) as client:
            return await asyncio.gather(*(send(client, texts, i % 2 == 0)
                                          for i, texts in enumerate(lists)))

    prompts = [tokenizer.encode(text) for text in lists[0]]
    shared = next(i for i, column in enumerate(zip(*prompts)) if len(set(column)) > 1)
    stayed = [(texts, body) for texts, body in zip(lists, asyncio.run(everyone())) if body]
    cached = sum(body["usage"]["prompt_tokens_details"]["cached_tokens"] for _, body in stayed)
    assert cached >= (3 * len(stayed) - 1) * shared
    for texts, body in stayed:
        for item, text in zip(body["data"], texts):
            expected = last_logprobs(model, tokenizer.encode(text))
            assert item["token_id"] == int(np.argmax(expected))
            assert abs(item["logprob"] - expected.max()) < LOGPROB_TOLERANCE
    metrics = wait_idle(real_server)
    assert metrics["radix_mlx_running_requests"] == 0
    assert metrics["radix_mlx_tree_pinned_bytes"] == 0


@pytest.mark.parametrize(("yes", "no", "score"), [
    (-1.0, -1.0, 0.5), (0.0, -2000.0, 1.0), (-2000.0, 0.0, 0.0),
    (math.log(0.3), math.log(0.1), 0.75)])
def test_a_judges_score_is_finite_at_any_gap(yes: float, no: float, score: float) -> None:
    assert judge_score(yes, no) == pytest.approx(score)


def test_rerank_judge_equals_mlx_lm(real_server: ServerProcess, reference) -> None:
    """Each document's score is P(yes) / (P(yes) + P(no)) after the judge prompt, as a
    direct forward gives it, and the results come sorted by it (a 135M judge's order, not
    necessarily a good one); the query's prefix is computed once: a later document
    finds it cached."""
    model, tokenizer = reference
    query = "What is the capital of France?"
    documents = ["Paris is the capital and largest city of France.",
                 "Bananas are a yellow fruit rich in potassium.",
                 "The Eiffel Tower stands in Paris, the French capital."]
    yes, no = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    expected = []
    for document in documents:
        tokens = tokenizer.apply_chat_template(
            [{"role": "system", "content": JUDGE_SYSTEM},
             {"role": "user", "content": f"<Instruct>: {JUDGE_INSTRUCTION}\n"
              f"<Query>: {query}\n<Document>: {document}"}], add_generation_prompt=True)
        logprobs = last_logprobs(model, tokens)
        expected.append(1 / (1 + math.exp(logprobs[no] - logprobs[yes])))
    body = post(real_server, "/v1/rerank", {"query": query, "documents": documents,
                                            "return_documents": False})
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -expected[i])
    for result in results:
        assert abs(result["relevance_score"] - expected[result["index"]]) < 1e-3
        assert "document" not in result
    again = post(real_server, "/v1/rerank", {"query": query, "documents": ["Lyon."]})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 60


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank"])
def test_rerank_answers_where_other_clients_look(real_server: ServerProcess,
                                                 path: str) -> None:
    """llama.cpp's and vLLM's clients post to /rerank, Cohere's v2 SDK to /v2/rerank with
    a field of its own (ignored): the same results as /v1/rerank."""
    body = {"query": "capital of France", "top_n": 2,
            "documents": ["Paris is in France.", "Bananas are yellow.", "Lyon is French."]}
    expected = post(real_server, "/v1/rerank", body)["results"]
    results = post(real_server, path, {**body, "max_tokens_per_doc": 512})["results"]
    assert [r["index"] for r in results] == [r["index"] for r in expected]
    for result, reference in zip(results, expected):
        # The second request finds the query cached: a forward of another shape.
        assert abs(result["relevance_score"] - reference["relevance_score"]) < 1e-3


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_vllms_score_is_reranks_score_of_each_pair(real_server: ServerProcess,
                                                   path: str) -> None:
    """vLLM's score API: one query against each document (text_1, text_2, vLLM's first
    names), or each query against its own document (queries, documents), scored as
    /v1/rerank scores them and answered in the request's order, in vLLM's shape."""
    query = "capital of France"
    documents = ["Paris is in France.", "Bananas are yellow.", "Lyon is French."]
    ranked = post(real_server, "/v1/rerank", {"query": query, "documents": documents})
    expected = {r["index"]: r["relevance_score"] for r in ranked["results"]}
    body = post(real_server, path, {"text_1": query, "text_2": documents},
                request_id=f"score{path.replace('/', '-')}")
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert isinstance(body["created"], int) and body["model"] == ranked["model"]
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    assert all(item["object"] == "score" for item in body["data"])
    for item in body["data"]:
        assert abs(item["score"] - expected[item["index"]]) < 1e-3
    assert body["usage"]["prompt_tokens"] == ranked["usage"]["prompt_tokens"]
    assert f"prompt={body['usage']['prompt_tokens']} " in real_server.access_line(
        f"score{path.replace('/', '-')}")
    other = "largest fruit"
    alone = post(real_server, "/v1/rerank", {"query": other, "documents": documents[1:2]})
    paired = post(real_server, path, {"queries": [query, other, query],
                                      "documents": documents})
    scores = [item["score"] for item in paired["data"]]
    assert abs(scores[0] - expected[0]) < 1e-3 and abs(scores[2] - expected[2]) < 1e-3
    assert abs(scores[1] - alone["results"][0]["relevance_score"]) < 1e-3


def test_decoder_embeddings_share_their_instruction(real_server: ServerProcess,
                                                    reference) -> None:
    """Last-token pooling, L2-normalised, equal to the body's last hidden state; the
    instruction computed by one request is cached for the next ones."""
    model, tokenizer = reference
    instruction = ("Instruct: Given a web search query, retrieve relevant passages that "
                   "answer the query\nQuery: ")
    first = post(real_server, "/v1/embeddings", {"input": instruction + "apples"})
    texts = [instruction + t for t in ("pears", "ripe bananas", "the moon")]
    body = post(real_server, "/v1/embeddings", {"input": texts}, request_id="embed-shared")
    prefix = len(tokenizer.encode(instruction)) - 2
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < prefix
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 3 * prefix
    logged = real_server.access_line("embed-shared")
    assert f"prompt={body['usage']['prompt_tokens']} cached={cached} " in logged
    for item, text in zip(body["data"], texts):
        hidden = np.array(model.model(mx.array([tokenizer.encode(text)]))[0, -1])
        hidden /= np.linalg.norm(hidden)
        ours = np.array(item["embedding"])
        assert abs(np.linalg.norm(ours) - 1) < 1e-5
        assert float(ours @ hidden) >= 0.9999


def test_decoder_embeddings_cut_to_truncate_prompt_tokens(real_server: ServerProcess,
                                                          reference) -> None:
    """A text keeps its first k tokens (SmolLM2's tokenizer ends a text with no special
    token), the last-token embedding read there, as vLLM cuts a pooling model's input;
    token ids keep their first k too. A short input stays whole, and usage counts the
    tokens embedded."""
    model, tokenizer = reference
    text = "Instruct: find passages about fruit\nQuery: " + "ripe apples and pears " * 8
    ids, short = tokenizer.encode(text), tokenizer.encode(SENTENCES[0])
    assert len(short) < 12 < len(ids)
    body = post(real_server, "/v1/embeddings", {"input": [text, SENTENCES[0]],
                                                "truncate_prompt_tokens": 12})
    assert body["usage"]["prompt_tokens"] == 12 + len(short)
    for item, tokens in zip(body["data"], [ids[:12], short]):
        hidden = np.array(model.model(mx.array([tokens]))[0, -1])
        assert float(np.array(item["embedding"]) @ hidden) / np.linalg.norm(hidden) >= 0.9999
    by_ids = post(real_server, "/v1/embeddings", {"input": [ids], "truncate_prompt_tokens": 12})
    assert by_ids["usage"]["prompt_tokens"] == 12
    assert float(np.array(by_ids["data"][0]["embedding"])
                 @ np.array(body["data"][0]["embedding"])) >= 0.9999


def test_a_cut_text_keeps_the_special_token_its_tokenizer_ends_it_with(
        real_model_dir: Path) -> None:
    """Qwen3-Embedding's tokenizer appends <|endoftext|>, the token its last-token pooling
    reads: a text cut short keeps it at its end, as Hugging Face's truncation does."""
    backend = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    eos = backend.token_to_id("<|endoftext|>")
    backend.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eos)])
    assert trailing_specials(backend) == 1
    ids = backend.encode("one two three four five six").ids
    assert ids[-1] == eos and _truncated(ids, 4, 1) == [*ids[:3], eos]
    backend.enable_truncation(4)
    assert backend.encode("one two three four five six").ids == _truncated(ids, 4, 1)


def test_decoder_embeddings_refuse_matryoshka_before_computing_any(
        real_server: ServerProcess) -> None:
    steps = real_server.metrics()["radix_mlx_engine_steps_total"]
    response = httpx.post(f"{real_server.url}/v1/embeddings", headers=AUTH, timeout=60,
                          json={"input": ["a sentence to embed"] * 256, "dimensions": 8})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "dimensions"
    assert real_server.metrics()["radix_mlx_engine_steps_total"] == steps


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"query": "word " * 9000, "documents": ["a"]}, "query", "maximum context length"),
    ({"query": "q", "instruction": "word " * 9000, "documents": ["a"]}, "instruction",
     "maximum context length"),
    ({"query": "q", "documents": ["a", "word " * 9000]}, "documents[1]",
     "maximum context length"),
    ({"query": "q", "documents": ["a", ""]}, "documents[1]", "is empty"),
    ({"query": "q", "documents": [{"text": ""}]}, "documents[0]", "is empty"),
])
def test_a_bad_rerank_query_or_document_is_a_400_naming_it(
        real_server: ServerProcess, body: dict, param: str, words: str) -> None:
    """The judge reads the query in every document's prompt: one too long is the query's
    fault, not the first document's."""
    response = httpx.post(f"{real_server.url}/v1/rerank", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param} "), error
    assert words in error["message"]


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/embeddings", {"input": {"text": "a"}},
     f"input: must be {PROMPT_SHAPES}"),
    ("/v1/embeddings", {"input": [-1]}, "input.0: Input should be greater than or equal to 0"),
    ("/v1/embeddings", {"input": ["a", 1]}, "input.1: Input should be a valid string"),
    ("/v1/classify", {"input": ["a", {"text": "b"}]},
     "input.1: must be a string or a list of token ids"),
    ("/v1/rerank", {"query": "q", "documents": ["a", 1]},
     ("documents.1: must be a string or an object (its text, or the fields rank_fields "
      "names)")),
    ("/v1/rerank", {"query": "q", "documents": ["a", {"title": "b"}]},
     "documents[1] has no text: send one, or rank_fields naming the fields to rank it by"),
    ("/v1/score", {"text_1": "q", "text_2": {"content": []}},  # vLLM's multimodal
     "text_2: must be a string or a list of strings"),
])
def test_an_input_of_the_wrong_shape_gets_one_error_saying_what_it_must_be(
        real_server: ServerProcess, path: str, body: dict, message: str) -> None:
    """Not one error per member of the union the field's type is."""
    response = httpx.post(f"{real_server.url}{path}", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == message


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/classify", {"input": []}, "input"),
    ("/v1/classify", {"input": ["ok", ""]}, "input[1]"),
    ("/v1/classify", {"input": [[1, 2], [1, 10**8]]}, "input[1]"),
    ("/v1/embeddings", {"input": [[1, 2], [1, 10**8]]}, "input[1]"),
    ("/v1/classify", {"input": ["a"] * 10_000}, "input"),
    ("/v1/classify", {"input": ["a"], "messages": [[{"role": "user", "content": "a"}]]},
     None),
    ("/v1/classify", {"input": ["a"], "labels": [""]}, None),
    ("/v1/classify", {"input": ["short", "word " * 9000]}, "input[1]"),
    ("/v1/classify", {"input": ["a"], "labels": [f" l{i}" for i in range(257)]}, "labels"),
    ("/v1/classify", {"input": ["a"], "labels": [" word" * 65]}, "labels"),
    # 2048 inputs and a label of 6 tokens: 10,240 continuations to read.
    ("/v1/classify", {"input": ["a"] * 2048, "labels": [" one two three four five six"]},
     "labels"),
    ("/v1/classify", {"input": ["a", [1] * 8190], "labels": [" one two three four"]},
     "input[1]"),
    # A chat too long, alone or with its longest label, is named as the chat.
    ("/v1/classify", {"messages": [[{"role": "user", "content": "hi"}],
                                   [{"role": "user", "content": "word " * 9000}]]},
     "messages[1]"),
    ("/v1/classify", {"messages": [[{"role": "user", "content": "word " * 8150}]],
                      "labels": [" word" * 40]}, "messages[0]"),
    ("/v1/rerank", {"query": "q", "documents": []}, None),
    ("/v1/score", {"text_1": "q", "text_2": []}, "documents"),
    ("/v1/score", {"queries": ["q", "r"], "documents": ["a", "b", "c"]}, "documents"),
    ("/v1/score", {"queries": ["q", ""], "documents": ["a", "b"]}, "queries[1]"),
    ("/v1/score", {"text_1": "q", "text_2": ["a", ""]}, "documents[1]"),
    ("/v1/score", {"text_1": "word " * 9000, "text_2": ["a"]}, "queries[0]"),
    ("/v1/embeddings", {"input": [""]}, "input[0]"),
    # A control character SmolLM2's tokenizer reads as no token at all.
    ("/v1/embeddings", {"input": ["a", "\x13"]}, "input[1]"),
    ("/v1/classify", {"input": ["\x13"]}, "input[0]"),
    ("/embedding", {"content": "a", "embd_normalize": 2**64}, "embd_normalize"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
])
def test_bad_input_is_a_400(real_server: ServerProcess, path: str, body: dict,
                            param: str | None) -> None:
    response = httpx.post(f"{real_server.url}{path}", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    assert post(real_server, "/v1/classify", {"input": ["fine"]})["data"]


@pytest.mark.parametrize(("path", "body"), [
    ("/api/embed", {"input": ["a", "\x13"]}),
    ("/embedding", {"content": "\x13"}),
    ("/embed", {"inputs": "\x13"}),
    ("/v1/embed", {"texts": ["\x13"], "input_type": "search_query"}),
])
def test_a_text_of_no_tokens_is_a_400_on_every_embedding_api(
        real_server: ServerProcess, real_model_dir: Path, path: str, body: dict) -> None:
    """Not empty, yet nothing to read: the engine refuses an empty prompt, which was a 500."""
    response = httpx.post(f"{real_server.url}{path}", json={"model": real_model_dir.name, **body},
                          headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    assert "encodes to no tokens" in response.text


@pytest.mark.parametrize("norm", [3, 1000, 2**31 - 1])
def test_llama_cpps_p_norm_of_any_p_scales_the_vector_to_norm_one(
        real_server: ServerProcess, norm: int) -> None:
    """embd_normalize p > 2 is llama.cpp's p-norm; a large p is near the largest value (its
    limit), where |x|^p in float32 underflowed to 0 and the vector came back huge."""
    body = {"content": "The capital of France is", "embd_normalize": norm}
    vector = np.array(post(real_server, "/embedding", body)[0]["embedding"][0], np.float64)
    assert np.isclose(np.sum(np.abs(vector) ** norm) ** (1 / norm) if norm < 10 else
                      np.abs(vector).max(), 1, rtol=1e-2)
