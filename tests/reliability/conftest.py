"""Servers for the reliability tests, each configured for what its tests provoke and
killed at the end of the module that used it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.support import (
    CACHE_BYTES,
    HEAD_TIMEOUT,
    MAX_BODY_BYTES,
    WRITE_TIMEOUT,
    fault_token,
    launch,
    stop,
)
from tests.server.support import ServerProcess


@pytest.fixture(scope="module")
def hardened(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """API key, small body limit, short waits for a request's head and for a client to
    read its response, a 2 MiB radix budget
    (so eviction runs) and the fault token armed: a request that sends it fails its
    forward pass."""
    server = launch(
        demo_model_dir, tmp_path_factory.mktemp("hardened") / "server.log",
        "--cache-bytes", str(CACHE_BYTES), "--max-body-bytes", str(MAX_BODY_BYTES),
        "--request-head-timeout", str(HEAD_TIMEOUT), "--write-timeout", str(WRITE_TIMEOUT),
        fault_token=fault_token(demo_model_dir),
    )
    yield server
    stop(server)
