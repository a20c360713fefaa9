"""LM Studio's own REST API (v0), as its docs (lmstudio.ai/docs/developer/rest/endpoints)
define it: its model objects. Its errors are OpenAI's error object.
"""

from __future__ import annotations

from typing import Literal

from server.schema import ResponseModel


class ModelEntry(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    type: Literal["llm", "vlm", "embeddings"]
    publisher: str
    arch: str
    compatibility_type: Literal["mlx", "gguf"]
    quantization: str
    state: Literal["loaded", "not-loaded"]
    max_context_length: int | None  # None: never loaded, and its config names none
    capabilities: list[Literal["tool_use"]]


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelEntry]
