"""The Host check of a server on a loopback address (server/http/hosts.py): a page whose
name is rebound to 127.0.0.1 is refused, local names and the clients' addresses are not."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import httpx
import pytest

from engine.api import EngineConfig
from engine.engine import Engine
from server.app import create_app
from server.config import Settings
from server.model_registry import ModelRegistry
from tests.server.support import ServerProcess

REBOUND = ["attacker.example", "attacker.example:8000", "127.0.0.1.attacker.example",
           "localhost.attacker.example", "x"]
LOCAL = ["localhost", "LOCALHOST:8000", "localhost.", "127.0.0.1", "[::1]:8000",
         "app.localhost", "printer.local", "host.docker.internal", "10.0.0.5:8000",
         socket.gethostname()]


@pytest.mark.parametrize("host", REBOUND)
def test_a_request_for_another_name_is_refused(server: ServerProcess, headers: dict[str, str],
                                               host: str) -> None:
    """DNS rebinding: a web page's name made to resolve to 127.0.0.1 reads the server's
    answers as its own; the browser still sends the page's name as the Host."""
    response = httpx.get(f"{server.url}/v1/models", headers={**headers, "Host": host})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "host_not_allowed"


@pytest.mark.parametrize("host", LOCAL)
def test_a_request_for_a_local_name_or_an_address_is_answered(
        server: ServerProcess, headers: dict[str, str], host: str) -> None:
    response = httpx.get(f"{server.url}/v1/models", headers={**headers, "Host": host})
    assert response.status_code == 200


@pytest.mark.parametrize(("path", "error"), [
    ("/api/tags", lambda body: body["error"]),
    ("/v1/messages/count_tokens", lambda body: body["error"]["type"]),
])
def test_the_refusal_speaks_the_api_of_its_path(server: ServerProcess, headers: dict[str, str],
                                                path: str, error) -> None:
    response = httpx.get(f"{server.url}{path}", headers={**headers, "Host": "attacker.example"})
    assert response.status_code == 403
    assert error(response.json())


def test_a_request_without_a_host_is_answered(server: ServerProcess) -> None:
    """HTTP/1.0 needs no Host: Ollama lets it through, and a page's fetch always has one."""
    address = urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as conn:
        conn.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert conn.makefile("rb").readline().startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(("settings", "host", "status"), [
    ({"host": "0.0.0.0"}, "attacker.example", 200),  # a LAN's server: its names are many
    ({"host": "192.168.1.5"}, "attacker.example", 200),
    ({"host": "::1"}, "attacker.example", 403),
    ({"host": "localhost"}, "attacker.example", 403),
    ({"allowed_hosts": ["llm.example.com"]}, "LLM.example.com:443", 200),
    ({"allowed_hosts": ["llm.example.com"]}, "attacker.example", 403),
    ({"allowed_hosts": ["*"]}, "attacker.example", 200),
])
async def test_the_check_is_for_a_loopback_server_and_its_allowed_hosts(
        settings: dict, host: str, status: int) -> None:
    config = Settings(**settings)
    app = create_app(config, ModelRegistry.of_one(config, Engine(EngineConfig(model="unused"))))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as client:
        assert (await client.get("/", headers={"Host": host})).status_code == status
