"""Which kind of encoder a model folder holds, read from its files without MLX: the
launcher asks it to pick the engine, and the server of a model not loaded yet (Ollama's
/api/show says what the model serves before its first load, as after it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BERT_ARCHITECTURE = "BertForSequenceClassification"
ROBERTA_ARCHITECTURES = ("XLMRobertaForSequenceClassification",
                         "RobertaForSequenceClassification")


def json_file(path: Path) -> Any:
    """A JSON file's value; {} where the folder has no such file."""
    return json.loads(path.read_text()) if path.is_file() else {}


def is_sentence_encoder(path: Path) -> bool:
    """Whether `path` is a sentence-transformers folder around a BERT-family encoder
    (not a cross-encoder's, which sentence-transformers also saves with a modules.json)."""
    config = path / "config.json"
    if not (path / "modules.json").is_file() or not config.is_file():
        return False
    config = json.loads(config.read_text())
    return config.get("model_type") == "bert" and not is_sequence_classifier(config)


def is_sequence_classifier(config: dict) -> bool:
    """Whether a config.json's model is a Hugging Face *ForSequenceClassification."""
    return any(name.endswith("ForSequenceClassification")
               for name in config.get("architectures") or ())


def cross_encoder_architecture(path: Path) -> str | None:
    """The sequence classifier a folder's config.json names, where engine/cross_encoder.py
    serves it."""
    names = json_file(path / "config.json").get("architectures") or ()
    return next((name for name in names
                 if name in (BERT_ARCHITECTURE, *ROBERTA_ARCHITECTURES)), None)


def is_cross_encoder(path: Path) -> bool:
    return cross_encoder_architecture(path) is not None
