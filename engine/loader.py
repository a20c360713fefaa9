"""Loading a model the way mlx-lm does, plus the facts the scheduler needs about it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.utils import hf_repo_to_path, load, load_config
from mlx_lm.utils import load_tokenizer as load_mlx_lm_tokenizer

from engine.distributed import RankGroup, shard
from engine.image_tokens import read_image_tokens
from engine.mlx_lm_internals import use_engine_kernels
from engine.model_config import config_int, context_length
from engine.tokenizer import ModelTokenizer
from engine.vision import Vision

log = logging.getLogger("radix_mlx.engine")


def failed_load(error: Exception) -> str:
    """Log why a model did not load, and say it in a line (the engine's `error`). What an
    operator got wrong (a path that is no model, a file that is no GGUF, a hub repo not
    at hand offline, too little memory for it) is one line, at every retry; its traceback
    is for debugging. Anything else is a bug, and logged with its traceback."""
    reason = f"{type(error).__name__}: {error}"
    if isinstance(error, OSError | ValueError):
        log.error("model failed to load: %s", reason)
        log.debug("the load that failed", exc_info=error)
    else:
        log.error("model failed to load", exc_info=error)
    return reason


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: ModelTokenizer
    model_id: str
    context_length: int
    vocab_size: int
    weight_bytes: int
    path: Path  # the local directory the weights were read from
    vision: Vision | None = None  # a vision model's image side (not under tensor parallelism)


def model_id_for(path_or_repo: str) -> str:
    """A local directory is named by its directory name, a hub repo by its repo id."""
    path = Path(path_or_repo).expanduser()
    return path.name if path.exists() else path_or_repo


def load_model(path_or_repo: str, group: RankGroup | None = None,
               chat_template: str | None = None) -> LoadedModel:
    """Load with mlx-lm. A local directory never touches the network; a hub repo id is
    downloaded by huggingface_hub, which shows its own progress bar. With a tensor-parallel
    `group`, the model is sharded before its weights are read, so a rank reads and keeps
    only its own slices (as mlx-lm's `sharded_load` does). `chat_template` replaces the
    model's own."""
    local = Path(path_or_repo).expanduser()
    if not local.exists() and path_or_repo.startswith(("/", ".", "~")):
        # No repo id starts so: without this, the hub reports an invalid repo id.
        raise FileNotFoundError(f"no model directory at {local}")
    source = str(local) if local.exists() else path_or_repo
    model, tokenizer, config = load(source, tokenizer_config=_template_config(chat_template),
                                    return_config=True, lazy=group is not None)
    use_engine_kernels(model)
    if group is not None:
        shard(model, config, group)
        mx.eval(model.parameters())
    weight_bytes = sum(v.nbytes for _, v in nn.utils.tree_flatten(model.parameters()))
    vocab_size = config_int(config, ("vocab_size",)) or len(tokenizer.vocab)
    path = local if local.exists() else hf_repo_to_path(path_or_repo)
    model_tokenizer = _model_tokenizer(tokenizer, path)
    vision = None
    if model_tokenizer.images is not None and group is None:
        vision = Vision(path, model, model_tokenizer.images)
        weight_bytes += vision.weight_bytes
    return LoadedModel(model, model_tokenizer, model_id_for(path_or_repo), context_length(config),
                       vocab_size, weight_bytes, path, vision)


def load_tokenizer(path: Path, chat_template: str | None = None) -> ModelTokenizer:
    """The tokenizer of the model directory at `path`, as `load_model` gives it (with the
    end-of-sequence ids of its config), without its weights."""
    eos_token_ids = load_config(path).get("eos_token_id")
    return _model_tokenizer(load_mlx_lm_tokenizer(
        path, _template_config(chat_template), eos_token_ids=eos_token_ids), path)


def _model_tokenizer(wrapper: Any, path: Path) -> ModelTokenizer:
    """mlx-lm's tokenizer wrapper, with the image tokens of a vision model's folder."""
    return ModelTokenizer(wrapper, read_image_tokens(path, wrapper.decode))


def _template_config(chat_template: str | None) -> dict[str, Any] | None:
    """What transformers' tokenizer loader takes to replace the chat template (as mlx-lm's
    server does for its --chat-template)."""
    return None if chat_template is None else {"chat_template": chat_template}
