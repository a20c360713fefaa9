"""A thin HTTP proxy between a coding agent and the server that steers a tiny model.

Gemma 3 270M (a base model) neither calls tools on its own nor ends a turn, so the proxy
rewrites the two things an agent leaves to the model: while the conversation holds no
tool result, it forces one call of one harmless tool; after that, it asks for a one-word
JSON answer (tool_choice none, which still shows the tools, so the prompt stays cached),
which the grammar ends. Sampling is greedy, so runs repeat. Everything else, streamed replies included, passes
through unchanged, and each request's path, tool choice and status are recorded.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

DONE = {"type": "object", "properties": {"answer": {"enum": ["done"]}},
        "required": ["answer"], "additionalProperties": False}
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}


@dataclass
class Exchange:
    method: str
    path: str
    forced: str | None  # the tool forced on this request, if any
    body: bytes = b""  # as sent on
    status: int = 0


@dataclass
class Proxy:
    upstream: str
    # (request body) -> the tool to force, or None to ask for the JSON answer.
    pick_tool: Callable[[dict[str, Any]], str | None]
    exchanges: list[Exchange] = field(default_factory=list)

    def serve(self) -> tuple[str, Callable[[], None]]:
        """Start on a free port: (its URL, a function that stops it)."""
        server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()

        def stop() -> None:
            server.shutdown()
            server.server_close()

        return f"http://127.0.0.1:{server.server_port}", stop

    def steer(self, path: str, body: dict[str, Any]) -> str | None:
        if not path.startswith(("/v1/messages", "/v1/responses")) or "count_tokens" in path:
            return None
        tool = self.pick_tool(body)
        anthropic = path.startswith("/v1/messages")
        body["temperature"] = 0.0  # one run like the next: the tool result's size varies
        if anthropic:
            # Anthropic takes neither a temperature other than 1 nor a forced tool with
            # thinking on (nor does the server, for the temperature).
            body.pop("thinking", None)
        if tool is not None:
            body["tool_choice"] = (
                {"type": "tool", "name": tool, "disable_parallel_tool_use": True} if anthropic
                else {"type": "function", "name": tool})
            if not anthropic:
                body["parallel_tool_calls"] = False
        elif anthropic:
            if body.get("tools"):
                body["tool_choice"] = {"type": "none"}
            body["output_config"] = {"format": {"type": "json_schema", "schema": DONE}}
        else:
            if body.get("tools"):
                body["tool_choice"] = "none"
            body["text"] = {"format": {"type": "json_schema", "name": "done", "schema": DONE,
                                       "strict": True}}
        return tool

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                forced = None
                if raw and self.command == "POST":
                    body = json.loads(raw)
                    forced = proxy.steer(self.path, body)
                    raw = json.dumps(body).encode()
                exchange = Exchange(self.command, self.path, forced, raw)
                proxy.exchanges.append(exchange)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                with httpx.Client(timeout=None) as client, client.stream(
                        self.command, proxy.upstream + self.path, headers=headers,
                        content=raw) as reply:
                    exchange.status = reply.status_code
                    self.send_response(reply.status_code)
                    for key, value in reply.headers.items():
                        if key.lower() not in HOP_HEADERS:
                            self.send_header(key, value)
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    if self.command == "HEAD":
                        return
                    for chunk in reply.iter_raw():
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")

            do_GET = do_POST = do_HEAD = do_DELETE = _forward

            def handle(self) -> None:
                try:
                    super().handle()
                except ConnectionError:
                    pass  # the agent gave up on a request; leaving it cancels it upstream

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler
