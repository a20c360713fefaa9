"""The HTTP surface as an attacker sees it: no /v1 route without the key, no request
field that reaches the filesystem, the network or the model loader, bounded request
sizes, and a key that never shows up in a response or a log line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest
from fastapi import FastAPI

from engine.api import Lifecycle
from engine.engine import Engine
from server.app import create_app
from server.config import Settings
from server.http.errors import COHERE_EMBED_PATHS
from server.launch.serve import OPEN_FILES, engine_config
from server.model_registry import ModelRegistry
from tests.reliability.support import (
    API_KEY,
    AUTH,
    HEAD_TIMEOUT,
    MAX_BODY_BYTES,
    WRITE_TIMEOUT,
    app_schema,
    fault_token,
    server_command,
)
from tests.server.support import REPO_ROOT, START_TIMEOUT, ServerProcess, server_env

HELLO = [{"role": "user", "content": "Hello"}]


def v1_operations() -> list[tuple[str, str]]:
    """(method, path) of every /v1 operation the schema declares."""
    return [
        (method.upper(), path)
        for path, operations in app_schema()["paths"].items() if path.startswith("/v1/")
        for method in operations
    ]


def takes_model(method: str, path: str) -> bool:
    return method == "POST" or "{model}" in path


def request_for(
    method: str, path: str, model: str, response_id: str = "resp_unknown"
) -> dict[str, Any]:
    """httpx.request arguments for an otherwise valid call of the operation."""
    body: dict[str, Any] = {"model": model, "max_tokens": 2}
    if path in ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"):
        body["messages"] = HELLO
    elif path == "/v1/completions":
        body["prompt"] = "Hello"
    elif path in ("/v1/responses", "/v1/responses/input_tokens"):
        body |= {"input": "Hello", "max_output_tokens": 16}
    elif path in ("/v1/embeddings", "/v1/classify"):
        body["input"] = ["Hello"]
    elif path == "/v1/rerank":
        body |= {"query": "Hello", "documents": ["Hi", "Bye"]}
    elif path == "/v1/score":
        body |= {"text_1": "Hello", "text_2": ["Hi", "Bye"]}
    elif path == "/v1/embed":
        body["texts"] = ["Hello"]
    elif path == "/v1/fim/completions":
        body |= {"prompt": "def f(", "suffix": "):"}
    url = path.replace("{model}", quote(model, safe=""))  # so "../x" stays a model name
    url = url.replace("{response_id}", response_id)
    return {"method": method, "url": url, "json": body} if method == "POST" else {
        "method": method, "url": url}


def served_status(path: str) -> int:
    """A valid call's status on the demo model: 200, but where the operation needs what the
    model has not (fill in the middle: its 400 says it does not support insert)."""
    return 400 if path == "/v1/fim/completions" else 200


BAD_CREDENTIALS = {
    "none": {},
    "empty bearer": {"Authorization": "Bearer"},
    "wrong key": {"Authorization": "Bearer not-the-key"},
    "key prefix": {"Authorization": f"Bearer {API_KEY[:-1]}"},
    "key plus suffix": {"Authorization": f"Bearer {API_KEY}0"},
    "basic scheme": {"Authorization": f"Basic {API_KEY}"},
    "no scheme": {"Authorization": API_KEY},
    "wrong x-api-key": {"X-API-Key": "not-the-key"},
}


@pytest.mark.parametrize(("method", "path"), v1_operations())
@pytest.mark.parametrize("credentials", BAD_CREDENTIALS.values(), ids=BAD_CREDENTIALS.keys())
def test_every_v1_operation_refuses_a_missing_or_wrong_key(
    hardened: ServerProcess, demo_model_dir: Path, method: str, path: str,
    credentials: dict[str, str],
) -> None:
    with httpx.Client(base_url=hardened.url, headers=credentials, timeout=30) as http:
        response = http.request(**request_for(method, path, demo_model_dir.name))
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert error_kind(path, response) in ("invalid_api_key", "authentication_error")
    assert API_KEY not in response.text


def error_kind(path: str, response: httpx.Response) -> str:
    """OpenAI's error code, Anthropic's error type under /v1/messages; Cohere's error has
    only its message, which says what was refused in the words OpenAI's code stands for."""
    if path in COHERE_EMBED_PATHS:
        message = response.json()["message"]
        words = {"invalid API key": "invalid_api_key", "does not exist": "model_not_found"}
        return next((kind for said, kind in words.items() if said in message), message)
    error = response.json()["error"]
    return error["type"] if path.startswith("/v1/messages") else error["code"]


@pytest.mark.parametrize("body", [b"{bad", b"\xff\xfe", b'{"model": 3}'],
                         ids=["bad json", "not utf-8", "wrong types"])
def test_the_key_is_checked_before_the_body_is_read(hardened: ServerProcess, body: bytes) -> None:
    # An unauthenticated client learns nothing about its input, not even that it is bad.
    response = httpx.post(f"{hardened.url}/v1/chat/completions", content=body, timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_a_client_without_the_key_gets_its_401_before_sending_its_body(
        hardened: ServerProcess) -> None:
    """The key is read from the request's head: a client without it is answered before
    any of its body is read (4 MiB bodies that never arrive, sent by hundreds, were read
    and held, up to the body limit each, before their 401)."""
    host, port = urlsplit(hardened.url).hostname, urlsplit(hardened.url).port
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
        head = conn.recv(65536)  # no byte of the body sent
    assert head.startswith(b"HTTP/1.1 401"), head[:200]


@pytest.mark.parametrize("sent", [b"", b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"])
def test_a_connection_whose_head_never_ends_is_closed(hardened: ServerProcess,
                                                       sent: bytes) -> None:
    """Slowloris: clients that open connections and send nothing, or a head a byte at a
    time, held a connection and a file descriptor each as long as they liked, until the
    server could accept no one. A head has --request-head-timeout seconds to arrive."""
    host, port = urlsplit(hardened.url).hostname, urlsplit(hardened.url).port
    with socket.create_connection((host, port), timeout=HEAD_TIMEOUT + 30) as conn:
        conn.sendall(sent)
        answer = b""
        while chunk := conn.recv(4096):  # until the server closes it
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


@pytest.mark.parametrize("framing", [b"Content-Length: 1000\r\n\r\n{\"messages\": [",
                                     b"Transfer-Encoding: chunked\r\n\r\n10\r\n{\"messages\": ["],
                         ids=["content-length", "chunked"])
def test_a_connection_whose_body_stops_coming_is_closed(hardened: ServerProcess,
                                                         framing: bytes) -> None:
    """Slowloris past the head: a client that sends a whole head, then part of its body
    and no more, held its connection and a file descriptor for as long as it liked. A
    body may pause --request-head-timeout seconds between its reads."""
    host, port = urlsplit(hardened.url).hostname, urlsplit(hardened.url).port
    with socket.create_connection((host, port), timeout=HEAD_TIMEOUT + 30) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                     % API_KEY.encode() + framing)
        answer = b""
        while chunk := conn.recv(4096):  # until the server closes it
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert "Traceback" not in hardened.log()


@pytest.mark.parametrize("framing", [b"Content-Length: 1000\r\n\r\n{\"messages\": [",
                                     b"Transfer-Encoding: chunked\r\n\r\n10\r\n{\"messages\": ["],
                         ids=["content-length", "chunked"])
def test_a_body_its_client_cut_off_is_logged_as_the_clients_leaving(
        hardened: ServerProcess, framing: bytes) -> None:
    """A client that closes its connection mid-body left: the operator reads nginx's 499
    (client closed request) in the access log, not a 400 that blames the request."""
    host, port = urlsplit(hardened.url).hostname, urlsplit(hardened.url).port
    request_id = f"cut-off-{uuid.uuid4().hex[:8]}"
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: %s\r\n" % (API_KEY.encode(), request_id.encode())
                     + framing)
        time.sleep(0.5)  # the route is reading the body
    line = hardened.access_line(request_id)
    assert "POST /v1/chat/completions 499 " in line, line


def test_a_stream_with_requests_pipelined_behind_it_ends_when_its_client_leaves(
        hardened: ServerProcess, demo_model_dir: Path) -> None:
    """A client that pipelined a second request behind a stream, then closed the
    connection: uvicorn told only the queued request that its client had gone, and the
    stream decoded on to its max_tokens for no one, holding its row."""
    max_tokens = 4000
    body = json.dumps({
        "model": demo_model_dir.name, "prompt": "Hello", "stream": True,
        "max_tokens": max_tokens, "ignore_eos": True}).encode()
    host, port = urlsplit(hardened.url).hostname, urlsplit(hardened.url).port
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"X-Request-Id: pipelined-first\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
                     % (API_KEY.encode(), len(body), body))
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
    line = hardened.access_line("pipelined-first", timeout=60)
    assert "POST /v1/completions 499 " in line, line
    assert int(line.split(" completion=")[1].split()[0]) < max_tokens


def test_a_request_offering_an_upgrade_to_http2_is_answered_over_http11(
        hardened: ServerProcess, demo_model_dir: Path) -> None:
    """curl --http2 and Java's HttpClient offer `Upgrade: h2c` on http:// URLs: the
    request was served without its body (a 400 for fields it had sent). The offer is
    declined, as RFC 9110 allows, and the request answered whole."""
    body = json.dumps({"model": demo_model_dir.name, "prompt": "Hello",
                       "max_tokens": 2}).encode()
    host, port = urlsplit(hardened.url).hostname, urlsplit(hardened.url).port
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
            b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\nContent-Length: %d\r\n\r\n"
            % (API_KEY.encode(), len(body)))
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(head + body[:10])  # the rest of the body in a later read
        time.sleep(0.2)
        conn.sendall(body[10:])
        answer = b""
        while chunk := conn.recv(4096):  # the connection closes after the answer
            answer += chunk
    head_part, _, content = answer.partition(b"\r\n\r\n")
    assert head_part.startswith(b"HTTP/1.1 200"), answer[:300]
    assert json.loads(content)["usage"]["completion_tokens"] == 2


def test_a_stream_whose_client_stops_reading_is_cut_off(
        hardened: ServerProcess, demo_model_dir: Path) -> None:
    """A client that keeps its connection open and reads nothing: the engine decoded the
    request to its max_tokens and held every event unread in memory (30 such streams: 107
    MiB). After --write-timeout seconds without a byte taken, the connection is closed
    and the generation cancelled. 16 choices with logprobs fill the socket's buffers in
    a fraction of the 6000 tokens asked for."""
    body = json.dumps({
        "model": demo_model_dir.name, "prompt": "Hello", "stream": True, "n": 16,
        "max_tokens": 6000, "ignore_eos": True, "logprobs": 5,
        "logit_bias": {str(fault_token(demo_model_dir)): -100}}).encode()
    host, port = urlsplit(hardened.url).hostname, urlsplit(hardened.url).port
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.settimeout(WRITE_TIMEOUT + 60)
        conn.connect((host, port))
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Request-Id: unread\r\n"
                     b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (API_KEY.encode(), len(body), body))
        line = hardened.access_line("unread", timeout=60)
        answer = b""
        while chunk := conn.recv(1 << 20):  # what the kernel holds, then the close
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and not answer.endswith(b"0\r\n\r\n")
    assert "request unread: its client took no bytes" in hardened.log()
    completion = int(line.split(" completion=")[1].split()[0])
    assert completion < 16 * 6000


def test_one_plain_stream_whose_client_stops_reading_is_cut_off(
        hardened: ServerProcess, demo_model_dir: Path) -> None:
    """One stream's few KB a second never filled the transport's buffer, which the write
    timeout watches: the kernel took every byte into a send buffer that grows to MiBs,
    and the request decoded to its max_tokens (8,000 tokens, 1.8 MB held). The kernel now
    holds little past what the client has room for, so the timeout sees the stall."""
    max_tokens = 4000  # about 1 MB of events: all of it fitted in the kernel's buffer
    body = json.dumps({
        "model": demo_model_dir.name, "prompt": "Hello", "stream": True,
        "max_tokens": max_tokens, "ignore_eos": True}).encode()
    host, port = urlsplit(hardened.url).hostname, urlsplit(hardened.url).port
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.connect((host, port))
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"X-Request-Id: unread-one\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (API_KEY.encode(), len(body), body))
        line = hardened.access_line("unread-one", timeout=300)
    assert "request unread-one: its client took no bytes" in hardened.log()
    assert int(line.split(" completion=")[1].split()[0]) < max_tokens


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc")
def test_the_server_raises_its_open_files_limit(hardened: ServerProcess) -> None:
    """Each connection holds a descriptor: the soft limit a service manager gives (launchd:
    256) is raised to the hard one, up to OPEN_FILES."""
    limits = Path(f"/proc/{hardened.process.pid}/limits").read_text()
    [line] = [line for line in limits.splitlines() if line.startswith("Max open files")]
    soft, hard = (int(value) if value.isdigit() else None for value in line.split()[3:5])
    assert soft == (OPEN_FILES if hard is None else min(hard, OPEN_FILES))


FLOODED_LOG = """
import logging, sys
from pathlib import Path
from server.launch.logs import configure_logging
configure_logging("info", Path(sys.argv[1]))
for _ in range(100):
    logging.getLogger("asyncio").error(
        "socket.accept() out of system resource\\nsocket: <...>", exc_info=OSError(24))
logging.getLogger("asyncio").error("Task exception was never retrieved")
"""


def test_running_out_of_descriptors_logs_once_a_minute_not_per_connection(
        tmp_path: Path) -> None:
    """asyncio logs a traceback for each connection it cannot accept, every second, while
    the process is out of descriptors: 184 MB of log in 30 s of a flood."""
    log_file = tmp_path / "server.log"
    subprocess.run([sys.executable, "-c", FLOODED_LOG, str(log_file)], check=True,
                   cwd=Path(__file__).parents[2])
    text = log_file.read_text()
    assert text.count("socket.accept() out of system resource") == 1
    assert "Task exception was never retrieved" in text


@pytest.mark.parametrize(("method", "path"), v1_operations())
def test_every_v1_operation_serves_the_right_key(
    hardened: ServerProcess, demo_model_dir: Path, method: str, path: str
) -> None:
    with httpx.Client(base_url=hardened.url, headers=AUTH, timeout=30) as http:
        stored = "resp_unknown"
        if "{response_id}" in path:  # a stored response to get or delete
            stored = http.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 16})
            stored = stored.json()["id"]
        response = http.request(**request_for(method, path, demo_model_dir.name, stored))
    assert response.status_code == served_status(path), response.text


# -- no request field reaches the filesystem, the network or the loader ------------------

HOSTILE_MODELS = [
    "/etc/passwd", "../x", "../../../../etc/shadow", "~/.ssh/id_rsa", "file:///etc/passwd",
    "http://169.254.169.254/latest/meta-data", "mlx-community/Qwen2.5-0.5B-Instruct-4bit",
    "tiny-seed0/../tiny-seed0",
]
# What Python audits when code opens files, lists directories, connects or runs programs.
WATCHED_EVENTS = ("open", "os.listdir", "os.scandir", "os.remove", "os.rename", "os.mkdir",
                  "shutil.", "socket.connect", "socket.getaddrinfo", "socket.bind",
                  "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork")


class SideEffects:
    """Records the watched audit events and stat calls while `watching`. Audit hooks
    cannot be removed, so the hook stays and only records inside the block."""

    def __init__(self) -> None:
        self.events: list[tuple[str, tuple]] = []
        self.active = False
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args: tuple) -> None:
        if self.active and event.startswith(WATCHED_EVENTS):
            self.events.append((event, args))

    @contextmanager
    def watching(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, tuple]]]:
        # Existence checks are stats, which Python does not audit.
        for name in ("stat", "lstat", "access"):
            monkeypatch.setattr(os, name, self._recording(name, getattr(os, name)))
        self.events.clear()
        self.active = True
        try:
            yield self.events
        finally:
            self.active = False
            monkeypatch.undo()

    def _recording(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.events.append((f"os.{name}", args))
            return function(*args, **kwargs)

        return record


@pytest.fixture(scope="module")
def in_process(demo_model_dir: Path) -> Iterator[tuple[FastAPI, SideEffects]]:
    """The app on a real engine in this process, where its side effects can be watched."""
    settings = Settings(model=str(demo_model_dir), api_key=API_KEY, cache_bytes=2**20,
                        disk_cache_bytes=0)
    engine = Engine(engine_config(settings, str(demo_model_dir)))
    engine.start()
    assert engine.wait_ready(120) is Lifecycle.READY, engine.error
    yield create_app(settings, ModelRegistry.of_one(settings, engine)), SideEffects()
    engine.shutdown()


@pytest.mark.parametrize(("method", "path"),
                         [operation for operation in v1_operations() if takes_model(*operation)])
async def test_no_model_name_reaches_the_filesystem_network_or_loader(
    in_process: tuple[FastAPI, SideEffects], monkeypatch: pytest.MonkeyPatch,
    demo_model_dir: Path, method: str, path: str,
) -> None:
    app, side_effects = in_process
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app.localhost", headers=AUTH,
                                 timeout=60) as client:
        # Warm: lazy imports on the error path would otherwise count as file reads.
        served = request_for(method, path, demo_model_dir.name)
        assert (await client.request(**served)).status_code == served_status(path)
        await client.request(**request_for(method, path, "unknown"))
        for model in HOSTILE_MODELS:
            with side_effects.watching(monkeypatch) as events:
                response = await client.request(**request_for(method, path, model))
            assert response.status_code == 404, (model, response.text)
            assert error_kind(path, response) in ("model_not_found", "not_found_error")
            assert events == [], model


CHAT_TEMPLATE_OPTIONS = {
    "template swapped for a loop of 10^10 steps": {
        "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}"
                         "{% endfor %}{% endfor %}"},
    "template that includes a file": {"chat_template": "{% include '/etc/passwd' %}"},
    "tensors": {"return_tensors": "np"},
    "tokenizer options": {"tokenizer_kwargs": {"add_special_tokens": 5}},
    "padding to any length": {"padding": "max_length", "max_length": 10**6},
    "the conversation itself": {"messages": 5},
    "the conversation under apply_chat_template's own name": {"conversation": []},
}


@pytest.mark.parametrize("variables", CHAT_TEMPLATE_OPTIONS.values(),
                         ids=CHAT_TEMPLATE_OPTIONS.keys())
def test_chat_template_kwargs_set_template_variables_only(
    hardened: ServerProcess, variables: dict[str, Any]
) -> None:
    """They are passed to the model's own template; apply_chat_template's options are not
    theirs to set (any Jinja template would freeze the event loop with one request)."""
    body = {"messages": HELLO, "max_tokens": 2, "chat_template_kwargs": variables}
    with httpx.Client(base_url=hardened.url, headers=AUTH, timeout=30) as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "chat_template_kwargs"
        variable = {**body, "chat_template_kwargs": {"enable_thinking": False}}
        assert http.post("/v1/chat/completions", json=variable).status_code == 200


# -- size limits ---------------------------------------------------------------------------


def raw_exchange(url: str, request: bytes, piece: int | None = None) -> bytes:
    """Send raw bytes (in pieces of `piece` bytes, if given) and return the response's
    status line; a server that hangs instead of answering fails on the socket timeout."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        try:
            for start in range(0, len(request), piece or len(request)):
                sock.sendall(request[start:start + (piece or len(request))])
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused while we were still sending: the answer is already waiting
        return sock.makefile("rb").readline()


HEAD = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + API_KEY.encode()
KIB = 1024
# The protocol refuses an incomplete request head past 64 KiB (server/http/uvicorn_protocol.py); a
# head that arrives within one socket read (up to ~128 KiB on loopback) is parsed whole,
# and the middleware refuses it (server/http/body_limit.py).
OVERSIZED = {
    "one 256 KiB header": (HEAD + b"\r\nX-Big: " + b"a" * 256 * KIB + b"\r\n\r\n", None),
    "100 KiB header in one write": (HEAD + b"\r\nX-Big: " + b"a" * 100 * KIB + b"\r\n\r\n", None),
    "100 KiB header in 8 KiB pieces": (
        HEAD + b"\r\nX-Big: " + b"a" * 100 * KIB + b"\r\n\r\n", 8 * KIB),
    # Never ends: refused by the count of its bytes, not by waiting for the head to end.
    "unfinished 1 MiB header in 8 KiB pieces": (HEAD + b"\r\nX-Big: " + b"a" * KIB * KIB, 8 * KIB),
    "30000 headers": (
        HEAD + b"\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(30000)) + b"\r\n", None),
    "256 KiB path": (b"GET /" + b"a" * 256 * KIB + b" HTTP/1.1\r\nHost: localhost\r\n\r\n", None),
    "body over the limit": (
        HEAD.replace(b"GET /v1/models", b"POST /v1/completions")
        + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % (MAX_BODY_BYTES + 1) + b" " * (MAX_BODY_BYTES + 1), None),
}


@pytest.mark.parametrize(("request_bytes", "piece"), OVERSIZED.values(), ids=OVERSIZED.keys())
def test_oversized_requests_are_refused_not_hung(
    hardened: ServerProcess, request_bytes: bytes, piece: int | None
) -> None:
    status_line = raw_exchange(hardened.url, request_bytes, piece)
    assert status_line.startswith((b"HTTP/1.1 400", b"HTTP/1.1 413")), status_line
    assert httpx.get(f"{hardened.url}/v1/models", headers=AUTH, timeout=30).status_code == 200


def test_a_body_over_the_limit_is_refused_and_its_connection_closed(
        hardened: ServerProcess) -> None:
    """The 413 goes out before the body is read: the connection is closed (as nginx does),
    not kept for the client to send, and the server to read and drop, all it declared."""
    host, port = urlsplit(hardened.url).hostname, urlsplit(hardened.url).port
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(HEAD.replace(b"GET /v1/models", b"POST /v1/completions")
                     + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % (MAX_BODY_BYTES + 1))
        answer = b""
        while chunk := conn.recv(4096):  # until the server closes it
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"\r\nconnection: close\r\n" in answer


UNREAD_BODIES = {
    "401 without the key": b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
    b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n",
    "403 for a foreign Host": b"POST /v1/completions HTTP/1.1\r\nHost: rebound.example\r\n"
    b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n",
    "400 for a head over the limit": HEAD.replace(b"GET /v1/models", b"POST /v1/completions")
    + b"\r\nX-Big: " + b"a" * 100 * KIB + b"\r\nContent-Length: 1000\r\n\r\n",
}


@pytest.mark.parametrize("request_bytes", UNREAD_BODIES.values(), ids=UNREAD_BODIES.keys())
def test_other_answers_before_the_body_is_read_close_the_connection_too(
        hardened: ServerProcess, request_bytes: bytes) -> None:
    """As a 413 does: the 401 for a missing key, the 403 for a Host not of this server and
    the 400 for a head over the limit go out before the body is read, and the connection stayed open for the server to read
    and drop all the body the client declared."""
    host, port = urlsplit(hardened.url).hostname, urlsplit(hardened.url).port
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(request_bytes)
        answer = b""
        while chunk := conn.recv(4096):  # until the server closes it
            answer += chunk
    assert answer.startswith((b"HTTP/1.1 401", b"HTTP/1.1 403", b"HTTP/1.1 400")), answer[:200]
    assert b"\r\nconnection: close\r\n" in answer


@pytest.mark.parametrize("codings", [b"gzip, chunked", b"x-unknown,chunked",
                                     b"gzip\r\nTransfer-Encoding: chunked"])
def test_a_body_in_a_transfer_coding_other_than_chunked_is_refused(
        hardened: ServerProcess, demo_model_dir: Path, codings: bytes) -> None:
    """The parser frames such a body by its chunks and hands on the bytes inside them
    undecoded: a gzip body was read as (invalid) JSON, an unknown coding's as if none.
    RFC 9112 6.1: a coding the server does not know is a 501."""
    body = b'{"model": "%s", "prompt": "Hi", "max_tokens": 1}' % demo_model_dir.name.encode()
    host, port = urlsplit(hardened.url).hostname, urlsplit(hardened.url).port
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(HEAD.replace(b"GET /v1/models", b"POST /v1/completions")
                     + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: %s\r\n\r\n"
                     b"%x\r\n%s\r\n0\r\n\r\n" % (codings, len(body), body))
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 501"), answer[:200]
    assert b'"code":"unsupported_transfer_encoding"' in answer


# -- the key stays secret ------------------------------------------------------------------


def test_request_ids_cannot_forge_log_lines(hardened: ServerProcess) -> None:
    """An id HTTP allows but a log line should not hold is replaced; one with a control
    character is not valid HTTP (RFC 9110 5.5), and the request is refused before it."""
    spaced = httpx.get(f"{hardened.url}/v1/models", timeout=30,
                       headers={**AUTH, "X-Request-Id": "a fake 200 line"})
    assert spaced.status_code == 200
    assert "fake" not in spaced.headers["x-request-id"]
    escaped = httpx.get(f"{hardened.url}/v1/models", timeout=30,
                        headers={**AUTH, "X-Request-Id": "a\x1b[2K forged 200 line"})
    assert escaped.status_code == 400
    assert "fake 200 line" not in hardened.log()
    assert "forged 200 line" not in hardened.log()


def test_the_key_never_appears_in_responses_or_logs(
    hardened: ServerProcess, demo_model_dir: Path
) -> None:
    """After right, wrong and failing requests (this module's and a traceback's worth),
    neither a response nor the server's whole log holds the key."""
    faulty = {"prompt": [fault_token(demo_model_dir)], "max_tokens": 2}
    with httpx.Client(base_url=hardened.url, timeout=30) as http:
        texts = [
            http.post("/v1/completions", json=faulty, headers=AUTH).text,
            http.get("/v1/models", headers={"Authorization": f"Basic {API_KEY}"}).text,
            http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}x"}).text,
            http.get("/metrics").text,
            http.get("/health").text,
        ]
    assert "internal" not in texts[0] and "engine_error" in texts[0]
    for text in [*texts, hardened.log()]:
        assert API_KEY not in text


def test_a_configuration_error_does_not_print_the_key(demo_model_dir: Path) -> None:
    """The one-line reason names the bad option and its value, never the key's."""
    command = [*server_command(demo_model_dir, 0), "--log-level", "loud"]
    result = subprocess.run(command, cwd=REPO_ROOT, env=server_env(), capture_output=True,
                            text=True, timeout=START_TIMEOUT, check=False)
    assert result.returncode == 2
    assert "invalid port" in result.stderr and "invalid log_level" in result.stderr
    assert API_KEY not in result.stdout + result.stderr
