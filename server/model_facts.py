"""What a served model is, read off its files without loading it: its config, its
format, family, size and quantization, and what it can do. Ollama's /api/tags and
/api/show and LM Studio's /api/v0/models word the same facts each their own way."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engine.encoder_folder import is_cross_encoder, is_sentence_encoder
from engine.model_config import context_length
from engine.weights_digest import weights_files
from engine.weights_summary import WeightsSummary, summarize
from server.model_registry import ServedModel


@dataclass(frozen=True)
class ModelFacts:
    source: str  # its directory, file or hub id; "" where none is known yet
    format: Literal["gguf", "safetensors"]  # what its source was; a GGUF is converted
    family: str  # its config's model_type; "" where no config is known yet
    parameters: int | None  # None where its weights' headers are not known yet
    bits: int | None  # an MLX-quantized model's width
    dtype: str  # its weights' main float dtype, "" where not known


def model_facts(model: ServedModel) -> ModelFacts:
    config = model_config(model)
    quantization = config.get("quantization") or {}
    source = str(model.spec.source or (model.engine.config.model if model.engine else ""))
    bits = quantization.get("bits")
    weights = _weights(model.model_dir, bits) if model.model_dir is not None else None
    # A GGUF converted as it loaded says so in its directory's config (the default model's
    # directory is that conversion): its format is still the GGUF's.
    converted = "gguf" in config
    return ModelFacts(source=source,
                      format="gguf" if source.endswith(".gguf") or converted else "safetensors",
                      family=str(config.get("model_type") or ""),
                      parameters=weights.parameters if weights else None, bits=bits,
                      dtype=weights.dtype if weights else "")


def weight_files_bytes(model: ServedModel, facts: ModelFacts) -> int:
    """The bytes of its weights' files, loaded or not (Ollama's /api/tags `size`, LM
    Studio's `size_bytes`): a GGUF file's (named, or as its conversion recorded it: the
    default model's), else its directory's safetensors; 0 where no directory is known yet
    (a hub id never loaded)."""
    source = Path(facts.source).expanduser()
    if facts.format == "gguf" and source.is_file():
        return source.stat().st_size
    converted = model_config(model).get("gguf")
    if isinstance(converted, dict) and isinstance(converted.get("bytes"), int):
        return converted["bytes"]
    directory = model.model_dir
    if directory is None:
        return 0
    return sum(path.stat().st_size for path in weights_files(directory))


@functools.cache
def _weights(directory: Path, bits: int | None) -> WeightsSummary | None:
    return summarize(directory, bits)


def model_config(model: ServedModel) -> dict[str, Any]:
    """The model's config.json (and its tokenizer's chat template); {} where no directory
    of it is known yet (a hub id or a GGUF file before its first load)."""
    path = model.model_dir
    return _read_config(path) if path is not None else {}


@functools.cache
def _read_config(directory: Path) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name in ("config.json", "tokenizer_config.json"):
        try:
            read = json.loads((directory / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(read, dict):
            config = {**read, **config}
    return config


def capabilities(model: ServedModel) -> list[str]:
    """What clients read to offer tools, images, thinking or embedding, in Ollama's words
    (`ServedModel.capabilities`). Before a model's first load, what its folder says, as
    ServedModel.capabilities says it once loaded: an encoder's files (embedding; a
    cross-encoder, nothing), else a chat template (tools), a vision tower."""
    known = model.capabilities
    if known is not None:
        return known
    directory = model.model_dir
    if directory is not None and is_cross_encoder(directory):
        return []
    if directory is not None and is_sentence_encoder(directory):
        return ["embedding"]
    config = model_config(model)
    if not (config.get("chat_template") or model.spec.chat_template):
        return ["completion"]
    return ["completion", "tools", *(["vision"] if "vision_config" in config else [])]


def context_window(model: ServedModel) -> int | None:
    """Its context window (OpenAI's max_input_tokens, LM Studio's max_context_length):
    its engine's once loaded; before, what its config and the operator's context_length
    will make it, as the engine does. None where no config is known yet (a hub id never
    loaded) and for an encoder, whose window its sentence-transformers files set."""
    if model.context_length is not None:
        return model.context_length
    config = model_config(model)
    if not config or "completion" not in capabilities(model):
        return None
    return context_length(config, model.settings.context_length)
