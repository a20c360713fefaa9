"""A Mac serving a team on its LAN: HTTPS with uvicorn's own TLS, and CORS for the
browser front ends its users run (off unless origins are named, never with credentials)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.support import API_KEY, REPO_ROOT, ServerProcess, server_env, start_server

BROWSER_ORIGIN = "https://chat.lan.example"
PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, as `openssl` makes one for a LAN host."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


@pytest.fixture(scope="module")
def tls_server(
    demo_model_dir: Path, certificate: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    cert, key = certificate
    process = start_server(
        demo_model_dir, tmp_path_factory.mktemp("tls-server") / "server.log",
        "--api-key", API_KEY, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
        "--cors-origin", BROWSER_ORIGIN,
    )
    yield process
    process.stop()


def test_the_api_answers_over_https(tls_server: ServerProcess) -> None:
    assert tls_server.url.startswith("https://")
    client = openai.OpenAI(
        base_url=f"{tls_server.url}/v1", api_key=API_KEY, max_retries=0,
        http_client=httpx.Client(verify=tls_server.verify),
    )
    reply = client.completions.create(model=None, prompt="Hello", max_tokens=2)
    assert reply.usage.completion_tokens == 2
    assert tls_server.metrics()["radix_mlx_generated_tokens_total"] >= 2


def test_an_untrusted_certificate_or_plain_http_gets_no_answer(
    tls_server: ServerProcess,
) -> None:
    with pytest.raises(httpx.ConnectError):  # verified against the system's CAs
        httpx.get(f"{tls_server.url}/health", timeout=10)
    with pytest.raises(httpx.TransportError):
        httpx.get(tls_server.url.replace("https://", "http://") + "/health", timeout=10)
    assert tls_server.process.poll() is None


@pytest.mark.parametrize("flags, message", [
    (["--ssl-certfile", "{cert}"], "ssl_certfile and ssl_keyfile must be set together"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "/nonexistent/key.pem"],
     "invalid ssl_keyfile from flag --ssl-keyfile: Value error, no such file"),
])
def test_a_tls_misconfiguration_stops_the_start_with_one_line(
    demo_model_dir: Path, certificate: tuple[Path, Path], flags: list[str], message: str
) -> None:
    command = [sys.executable, "-m", "server", "--model", str(demo_model_dir), "--config", "",
               "--api-key", API_KEY, *(f.format(cert=certificate[0]) for f in flags)]
    result = subprocess.run(command, cwd=REPO_ROOT, env=server_env(), capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]
    assert API_KEY not in result.stderr


def test_a_named_origin_gets_cors_headers_and_never_credentials(
    tls_server: ServerProcess,
) -> None:
    with httpx.Client(base_url=tls_server.url, verify=tls_server.verify, timeout=10) as http:
        preflight = http.options("/v1/chat/completions",
                                 headers={"Origin": BROWSER_ORIGIN, **PREFLIGHT})
        answer = http.get("/v1/models", headers={
            "Origin": BROWSER_ORIGIN, "Authorization": f"Bearer {API_KEY}"})
        refused = http.get("/v1/models", headers={"Origin": BROWSER_ORIGIN})
        stranger = http.options("/v1/chat/completions",
                                headers={"Origin": "https://elsewhere.example", **PREFLIGHT})
    # The preflight needs no key (a browser never sends one on it) ...
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == BROWSER_ORIGIN
    assert {"authorization", "content-type"} <= {
        name.strip() for name in preflight.headers["access-control-allow-headers"].split(",")}
    # ... the call itself does, and the browser may read the answer and the 401 alike.
    assert answer.status_code == 200
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    for response in (preflight, answer, refused):
        assert response.headers["access-control-allow-origin"] == BROWSER_ORIGIN
        assert "access-control-allow-credentials" not in response.headers
    assert stranger.status_code == 400
    assert "access-control-allow-origin" not in stranger.headers


def test_cors_is_off_unless_origins_are_named(
    server: ServerProcess, headers: dict[str, str]
) -> None:
    origin = {"Origin": BROWSER_ORIGIN}
    preflight = httpx.options(f"{server.url}/v1/chat/completions",
                              headers={**origin, **PREFLIGHT}, timeout=10)
    answer = httpx.get(f"{server.url}/v1/models", headers={**origin, **headers}, timeout=10)
    assert answer.status_code == 200
    for response in (preflight, answer):
        assert not any(name.startswith("access-control-") for name in response.headers)
