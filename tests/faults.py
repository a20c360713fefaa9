"""A model whose forward pass fails on one token id, to test that a failed forward pass
fails only the request that caused it, in engines of this process and in servers; one
whose forward pass never ends on one token id (a device that hangs); and one that calls
back once prefill has fed so many tokens, to cancel a request mid-prefill.

`python -m tests.faults TOKEN [serve flags]` is `python -m server [serve flags]` serving
that model: the same code path, with the engine's loader wrapped (`hang:TOKEN`: the
model that never ends; `slow-load:SECONDS`: any model, its loads that much slower).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import mlx.core as mx
from mlx import nn

from engine.distributed import RankGroup
from engine.loader import LoadedModel, load_model


class FaultInjectingModel:
    """A forward pass that feeds `token` raises, or with `hang` never returns."""

    def __init__(self, model: nn.Module, token: int, hang: bool = False) -> None:
        self._model = model
        self._token = token
        self._hang = hang

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if mx.any(inputs == self._token).item():
            if self._hang:
                threading.Event().wait()
            raise RuntimeError(f"injected fault on token {self._token}")
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class PrefillWatcher:
    """A model (the one given to `around`) that calls `then` once, as soon as the prompt
    chunks (forwards of several tokens) fed since `watch` reach `tokens` tokens; `fed`
    then says how many they were. The call comes while the engine's step is still
    running that chunk."""

    def __init__(self) -> None:
        self._model: nn.Module | None = None
        self._tokens = 0
        self._then: Callable[[], None] | None = None
        self.fed = 0

    def around(self, model: nn.Module) -> PrefillWatcher:
        self._model = model
        return self

    def watch(self, tokens: int, then: Callable[[], None]) -> None:
        self._tokens, self._then, self.fed = tokens, then, 0

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if self._then is not None and inputs.shape[1] > 1:
            self.fed += inputs.shape[1]
            if self.fed >= self._tokens:
                then, self._then = self._then, None
                then()
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def loader_wrapping(wrap: Callable[[nn.Module], Any]) -> Callable[..., LoadedModel]:
    """`load_model`, with the model it loads wrapped by `wrap`; patch it over
    `engine.engine.load_model`."""

    def load(path_or_repo: str, group: RankGroup | None = None,
             chat_template: str | None = None) -> LoadedModel:
        loaded = load_model(path_or_repo, group, chat_template)
        return replace(loaded, model=wrap(loaded.model))

    return load


def faulty_loader(token: int, hang: bool = False) -> Callable[..., LoadedModel]:
    """`load_model`, except that the model fails every forward pass that feeds `token`
    (with `hang`, never ends it)."""
    return loader_wrapping(lambda model: FaultInjectingModel(model, token, hang))


def slow_loader(seconds: float) -> Callable[..., LoadedModel]:
    """`load_model`, `seconds` slower: a load still running whatever the machine's speed
    when a test acts on the requests waiting for it."""

    def load(*args: Any, **kwargs: Any) -> LoadedModel:
        time.sleep(seconds)
        return load_model(*args, **kwargs)

    return load


# The server's engine process (engine/process.py) is spawned: it runs this module again
# as "__mp_main__", with the server's arguments, and so loads the same faulty model.
if __name__ in ("__main__", "__mp_main__"):
    import engine.engine

    mode, _, value = sys.argv[1].rpartition(":")
    engine.engine.load_model = (slow_loader(float(value)) if mode == "slow-load"
                                else faulty_loader(int(value), hang=mode == "hang"))
if __name__ == "__main__":
    from server.launch.cli import run

    run(["serve", *sys.argv[2:]])


def failing_first(call: Callable[..., Any], failures: list[Exception]) -> Callable[..., Any]:
    """`call`, raising each of `failures` (popped as they are raised) before it runs: a
    disk tier's `load` whose disk goes away for a while, say."""

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return call(*args, **kwargs)

    return flaky
