"""What a model's config.json says of it, read without MLX: the engine sizes a model's
context by it as it loads, and the server tells clients the same before any load."""

from __future__ import annotations

from typing import Any

# What a model whose config names no trained length gets.
DEFAULT_CONTEXT_LENGTH = 4096
_CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length",
                 "max_sequence_length", "context_length")


def config_int(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    """The first positive integer under one of `keys`, at the top level or in the
    `text_config` that multimodal configs nest the language model's settings in."""
    for source in (config, config.get("text_config") or {}):
        for key in keys:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def context_length(config: dict[str, Any], limit: int | None = None) -> int:
    """The context window a model of `config` is served with: what it was trained for,
    within the operator's `limit`."""
    trained = config_int(config, _CONTEXT_KEYS) or DEFAULT_CONTEXT_LENGTH
    return min(trained, limit or trained)
