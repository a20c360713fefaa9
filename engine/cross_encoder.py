"""Cross-encoder rerankers: a Hugging Face folder whose model is BERT's or (XLM-)RoBERTa's
encoder with a sequence-classification head (cross-encoder/ms-marco-MiniLM-L6-v2,
BAAI/bge-reranker-base...). It reads a query and a document as one input, and its one
logit, through the activation sentence-transformers' CrossEncoder applies, is the pair's
relevance score: what `CrossEncoder(path).predict(pairs)` gives.

The encoder is engine/bert.py's; the heads below keep Hugging Face's parameter names, so
a `model.safetensors` loads as it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx import nn

from engine.bert import (
    Bert,
    BertConfig,
    load_weights,
    max_input_tokens,
    sentence_transformers_modules,
)
from engine.encoder_folder import BERT_ARCHITECTURE, cross_encoder_architecture, json_file

# The activations a folder may name, by the torch class sentence-transformers stores.
ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "Sigmoid": mx.sigmoid,
    "Identity": lambda logits: logits,
}


class Pooler(nn.Module):
    """BERT's pooler: the first ([CLS]) token's last hidden state through dense and tanh."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def __call__(self, hidden: mx.array) -> mx.array:
        return mx.tanh(self.dense(hidden[:, 0]))


class BertForSequenceClassification(nn.Module):
    """[CLS] pooled, then a linear layer to the labels' logits. Its tokenizer gives the
    model token types: 0 for the query, 1 for the document."""

    def __init__(self, config: BertConfig, num_labels: int) -> None:
        super().__init__()
        self.bert = Bert(config)
        self.bert.pooler = Pooler(config)  # where Hugging Face keeps it: bert.pooler.*
        self.classifier = nn.Linear(config.hidden_size, num_labels)

    def __call__(self, ids: mx.array, attention: mx.array, token_types: mx.array | None
                 ) -> mx.array:
        return self.classifier(self.bert.pooler(self.bert(ids, attention, token_types)))


class RobertaClassificationHead(nn.Module):
    """The first (<s>) token's last hidden state through dense and tanh, then out_proj."""

    def __init__(self, config: BertConfig, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, num_labels)

    def __call__(self, hidden: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(hidden[:, 0])))


class RobertaForSequenceClassification(nn.Module):
    """(XLM-)RoBERTa's: its tokenizer gives the model no token types, so all are 0."""

    def __init__(self, config: BertConfig, num_labels: int) -> None:
        super().__init__()
        self.roberta = Bert(config)
        self.classifier = RobertaClassificationHead(config, num_labels)

    def __call__(self, ids: mx.array, attention: mx.array, token_types: mx.array | None
                 ) -> mx.array:
        return self.classifier(self.roberta(ids, attention))


@dataclass
class CrossEncoder:
    """A cross-encoder folder: the model, the activation of its logit, and the most
    tokens a (query, document) pair is cut to."""

    model: BertForSequenceClassification | RobertaForSequenceClassification
    activation: Callable[[mx.array], mx.array]
    max_length: int

    def __call__(self, ids: mx.array, attention: mx.array, token_types: mx.array | None
                 ) -> mx.array:
        """(batch,): each pair's relevance score."""
        return self.activation(self.model(ids, attention, token_types)[:, 0])


def load_cross_encoder(path: Path) -> CrossEncoder:
    config = json.loads((path / "config.json").read_text())
    # As Hugging Face counts them: its id2label, else num_labels, else its default 2.
    num_labels = len(config["id2label"]) if "id2label" in config else config.get(
        "num_labels", 2)
    if num_labels != 1:
        # sentence-transformers' CrossEncoder.rank refuses such a model too: its scores
        # are one per label (classes such as entailment), not one relevance.
        raise ValueError(f"the cross-encoder has {num_labels} labels: a reranker has one "
                         "(its logit is the relevance score)")
    # sentence-transformers saves a cross-encoder as its Transformer module alone; one
    # that chains more (Dense, LogitScore...) scores otherwise.
    sentence_transformers_modules(path, {"Transformer"})
    bert_config = BertConfig.from_dict(config)
    kind = (BertForSequenceClassification
            if cross_encoder_architecture(path) == BERT_ARCHITECTURE
            else RobertaForSequenceClassification)
    model = kind(bert_config, num_labels)
    model.load_weights(list(load_weights(path).items()))
    mx.eval(model.parameters())
    return CrossEncoder(model, activation(path, config), max_input_tokens(path, bert_config))


def activation(path: Path, config: dict) -> Callable[[mx.array], mx.array]:
    """The activation sentence-transformers' CrossEncoder applies to the logit: the first
    torch class the folder names (in the config it saves beside its modules.json, then
    config.json's, then config.json's key from before sentence-transformers 4), a name
    outside torch being ignored as it is there without trust_remote_code; else the
    sigmoid, its default for one label."""
    saved = (json_file(path / "config_sentence_transformers.json")
             if (path / "modules.json").is_file() else {})
    named = (saved.get("activation_fn"),
             (config.get("sentence_transformers") or {}).get("activation_fn"),
             config.get("sbert_ce_default_activation_function"))
    name = next((name for name in named if name and name.startswith("torch.")), None)
    if name is None:
        return mx.sigmoid
    kind = name.rsplit(".", 1)[-1]
    if kind not in ACTIVATIONS:
        raise ValueError(f"the cross-encoder's activation {name} is not supported; these "
                         f"are: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[kind]
