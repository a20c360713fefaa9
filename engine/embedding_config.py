"""What a model's `config.json` says about its embeddings, read without MLX (the server
checks a request's `dimensions` against it)."""

from __future__ import annotations

from typing import Any


def matryoshka_dimensions(config: dict[str, Any], width: int) -> tuple[int, ...] | None:
    """The sizes an embedding of `width` values may be cut to and stay meaningful
    (Matryoshka representation learning), as vLLM reads them: `matryoshka_dimensions`,
    or any size up to `width` where `is_matryoshka` is set; None: only `width` itself."""
    dimensions = config.get("matryoshka_dimensions")
    if dimensions is not None:
        return tuple(dimensions)
    return tuple(range(1, width + 1)) if config.get("is_matryoshka") else None
