"""What the routes and middleware share: the engine, settings, metrics, drain state and
the response store."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from engine.api import Lifecycle
from server.config import Settings
from server.http.drain import Drain
from server.http.errors import APIError
from server.metrics import Metrics
from server.responses.store import ResponseStore, open_store

if TYPE_CHECKING:
    from engine.api import EngineClient
    from engine.tokenizer import ModelTokenizer


@dataclass
class ServerState:
    settings: Settings
    engine: EngineClient
    metrics: Metrics = field(init=False)
    drain: Drain = field(default_factory=Drain)
    started: int = field(default_factory=lambda: int(time.time()))
    # Responses API responses stored for previous_response_id; closed by `serve`.
    responses: ResponseStore = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.engine)
        self.responses = open_store(
            self.settings.response_store_path, self.settings.response_store_size
        )

    def model_ids(self) -> list[str]:
        """The served model id first, then its aliases."""
        return list(dict.fromkeys([self.engine.model_id, *self.settings.served_model_names]))

    def check_model(self, model: str | None) -> str:
        """The name to answer with; another model's name is a 404 (and never a load)."""
        ids = self.model_ids()
        if model is None or model in self.settings.unnamed_model_aliases:
            return ids[0]
        if model not in ids:
            raise APIError(
                404, f"The model '{model}' does not exist; this server serves {ids}.",
                code="model_not_found", param="model",
            )
        return model

    def ready_tokenizer(self) -> ModelTokenizer:
        """The tokenizer once the model is ready; 503 before (or after a failed load)."""
        engine = self.engine
        if engine.state is Lifecycle.READY and engine.tokenizer is None:
            raise APIError(400, f"the model {engine.model_id} is an embedding model: it "
                           "serves /v1/embeddings and /v1/rerank only",
                           code="model_not_supported", param="model")
        if engine.state is Lifecycle.READY:
            return engine.tokenizer
        if engine.state is Lifecycle.FAILED:
            message = f"the model failed to load: {engine.error}"
        else:
            message = f"the model is {engine.state.value}"
        raise APIError(503, message, code="model_not_ready")


def server_state(request: Request) -> ServerState:
    return request.app.state.server
