"""What a model is (server/model_facts.py) in LM Studio's words, which its v0 and v1
APIs both list: its type, publisher, format, quantization and context window."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from server.model_facts import (
    ModelFacts,
    capabilities,
    context_window,
    model_facts,
    weight_files_bytes,
)
from server.model_registry import ModelState, ServedModel

# A float dtype's bits per weight.
DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16}


@dataclass(frozen=True)
class Described:
    type: Literal["llm", "vlm", "embeddings"]
    publisher: str
    arch: str  # "" where no config is known yet
    format: Literal["mlx", "gguf"]
    quantization: str  # "" where its weights are not known yet
    bits_per_weight: int | None
    loaded: bool
    max_context_length: int | None  # None: no config known yet (a hub id), or an encoder not loaded
    tool_use: bool
    vision: bool
    parameters: int | None
    size_bytes: int  # its weights' files; 0 where none is known yet


def describe(model: ServedModel) -> Described:
    facts, can = model_facts(model), capabilities(model)
    return Described(
        type="embeddings" if "completion" not in can else "vlm" if "vision" in can else "llm",
        publisher=_publisher(facts), arch=facts.family,
        format="gguf" if facts.format == "gguf" else "mlx",
        quantization=_quantization(facts),
        bits_per_weight=facts.bits or DTYPE_BITS.get(facts.dtype),
        loaded=model.state is ModelState.LOADED,
        max_context_length=context_window(model),
        tool_use="tools" in can, vision="vision" in can, parameters=facts.parameters,
        size_bytes=weight_files_bytes(model, facts))


def _publisher(facts: ModelFacts) -> str:
    """Who published the model, as LM Studio names it by where its files are: a hub id's
    owner, a Hugging Face cache's owner, else the folder above the model's (LM Studio
    keeps publisher/model/, a GGUF file inside its model's folder); nobody known for a
    directory converted from a GGUF (the default model's), which says only its file."""
    source = facts.source
    path = Path(source).expanduser()
    if facts.format == "gguf" and path.is_dir():
        return ""
    if not source or not path.exists():
        owner, _, rest = source.partition("/")
        return owner if rest else ""
    cached = next((part for part in path.parts if part.startswith("models--")), None)
    if cached is not None:
        return cached.split("--")[1]
    return (path.parent if path.is_dir() else path.parent.parent).name


def _quantization(facts: ModelFacts) -> str:
    """An MLX model's bits ("4bit"), as LM Studio words them; a GGUF's quantization as
    Ollama's words it ("Q4"), which it is converted at; else its weights' dtype."""
    if not facts.bits:
        return facts.dtype
    return f"Q{facts.bits}" if facts.format == "gguf" else f"{facts.bits}bit"
