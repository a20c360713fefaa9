"""What a model's `config.json` says about its embeddings, read without MLX (the server
checks a request's `dimensions` against it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def matryoshka_dimensions(config: dict[str, Any], width: int) -> Sequence[int] | None:
    """The sizes an embedding of `width` values may be cut to and stay meaningful
    (Matryoshka representation learning), as vLLM reads them: `matryoshka_dimensions`
    (those up to `width`: a vector has no more), or any size up to `width` where
    `is_matryoshka` is set; None: only `width` itself."""
    dimensions = config.get("matryoshka_dimensions")
    if dimensions is not None:
        return tuple(d for d in dimensions if isinstance(d, int) and 0 < d <= width)
    return range(1, width + 1) if config.get("is_matryoshka") else None


def hidden_size(config: dict[str, Any]) -> int | None:
    """A causal model's hidden state width, from its config or its text model's (a
    vision model's); None where neither names it `hidden_size`."""
    return config.get("hidden_size") or config.get("text_config", {}).get("hidden_size")
