"""What the routes and middleware share: the models, settings, metrics, drain state and
the stores of conversations a follow-up continues."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from server.config import Settings
from server.http.drain import Drain
from server.metrics import Metrics
from server.model_registry import ModelRegistry
from server.responses.store import ResponseStore, open_store


@dataclass
class ServerState:
    settings: Settings
    models: ModelRegistry
    metrics: Metrics = field(init=False)
    drain: Drain = field(default_factory=Drain)
    started: int = field(default_factory=lambda: int(time.time()))
    # Responses API responses stored for previous_response_id; closed by `serve`.
    responses: ResponseStore = field(init=False)
    # LM Studio's /api/v1/chat conversations, for its previous_response_id: a store of
    # their own (a file beside the Responses one), since a Responses API GET of one would
    # find no Response in it.
    chats: ResponseStore = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.models)
        path, size = self.settings.response_store_path, self.settings.response_store_size
        self.responses = open_store(path, size)
        self.chats = open_store(None if path is None else
                                path.with_name(f"{path.stem}-lmstudio-chats{path.suffix}"), size)

    def close_stores(self) -> None:
        self.responses.close()
        self.chats.close()


def server_state(request: Request) -> ServerState:
    return request.app.state.server
