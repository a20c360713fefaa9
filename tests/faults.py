"""A model whose forward pass fails on one token id, to test that a failed forward pass
fails only the request that caused it, in engines of this process and in servers.

`python -m tests.faults TOKEN [serve flags]` is `python -m server [serve flags]` serving
that model: the same code path, with the engine's loader wrapped.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import mlx.core as mx
from mlx import nn

from engine.distributed import RankGroup
from engine.loader import LoadedModel, load_model


class FaultInjectingModel:
    def __init__(self, model: nn.Module, token: int) -> None:
        self._model = model
        self._token = token

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if mx.any(inputs == self._token).item():
            raise RuntimeError(f"injected fault on token {self._token}")
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def faulty_loader(token: int) -> Callable[..., LoadedModel]:
    """`load_model`, except that the model fails every forward pass that feeds `token`;
    patch it over `engine.engine.load_model`."""

    def load(path_or_repo: str, group: RankGroup | None = None,
             chat_template: str | None = None) -> LoadedModel:
        loaded = load_model(path_or_repo, group, chat_template)
        return replace(loaded, model=FaultInjectingModel(loaded.model, token))

    return load


# The server's engine process (engine/process.py) is spawned: it runs this module again
# as "__mp_main__", with the server's arguments, and so loads the same faulty model.
if __name__ in ("__main__", "__mp_main__"):
    import engine.engine

    engine.engine.load_model = faulty_loader(int(sys.argv[1]))
if __name__ == "__main__":
    from server.launch.cli import run

    run(["serve", *sys.argv[2:]])
