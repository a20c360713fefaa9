"""The engines keep the `EngineClient` contract the server is typed against: every
attribute and method it names, with parameters the server can pass."""

from __future__ import annotations

import inspect

import pytest

from engine.api import EngineClient, EngineConfig, EventStream
from engine.encoder import EncoderEngine
from engine.engine import Engine
from engine.process import EngineProcess
from engine.streams import RequestStream


def members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {name for name, value in vars(protocol).items()
              if callable(value) and not name.startswith("_")}
    return names


@pytest.mark.parametrize("make", [Engine, EngineProcess, EncoderEngine],
                         ids=["Engine", "EngineProcess", "EncoderEngine"])
def test_an_engine_has_every_member_of_the_contract(make):
    engine = make(EngineConfig(model="unused"))  # neither loads anything before start()
    for name in members(EngineClient):
        assert hasattr(engine, name), f"{type(engine).__name__} lacks {name}"
        wanted = getattr(EngineClient, name, None)
        if callable(wanted):
            have = inspect.signature(getattr(engine, name)).parameters
            for param in list(inspect.signature(wanted).parameters)[1:]:
                assert param in have, f"{type(engine).__name__}.{name} lacks {param}"


def test_the_request_stream_is_an_event_stream():
    stream = RequestStream("req-0", relay=None, cancel=lambda request_id: None)
    for name in [*members(EventStream), "__aiter__", "__anext__"]:
        assert hasattr(stream, name), f"RequestStream lacks {name}"
