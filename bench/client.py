"""An async OpenAI-compatible streaming client that times every request.

Plain sockets and SSE parsing rather than an SDK: the timings are of bytes arriving, the
client's own work stays small beside the server's (`Connection`), and the same code reads
every server's streams. TTFT is the first chunk carrying text; token
counts come from the final usage chunk (`stream_options.include_usage`), since a server
may pack several tokens into one chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Self

import httpx

from bench.workloads import Conversation, Workload

TIMEOUT = httpx.Timeout(1800.0, connect=10.0)


@dataclass
class RequestResult:
    conversation: int
    turn: int
    start: float  # seconds since the workload started
    ttft: float
    latency: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # None: the server did not report it
    text: str  # the reply, fed back as the next turn's history
    error: str | None = None  # the request failed; its numbers are not counted

    def as_dict(self) -> dict:
        """The record for results.json: figures, not the text (random-weight replies are
        noise, and they made each file megabytes)."""
        record = asdict(self)
        del record["text"]
        return record


@dataclass
class WorkloadRun:
    name: str
    wall_seconds: float
    requests: list[RequestResult]


class StreamError(RuntimeError):
    """The server answered with an error status or an error event."""


async def chat(connection: Connection, messages: list[dict[str, str]], max_tokens: int,
               extra: dict) -> tuple[float, float, dict, str]:
    """One streamed chat completion: (ttft, latency, usage, text)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    started = time.perf_counter()
    first = None
    usage: dict = {}
    parts: list[str] = []
    async with asyncio.timeout(TIMEOUT.read):
        async for data in connection.events("/v1/chat/completions", body):
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise StreamError(f"server error: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    parts.append(content)
    ended = time.perf_counter()
    return (first or ended) - started, ended - started, usage, "".join(parts)


async def run_conversation(connection: Connection, index: int, conversation: Conversation,
                           max_tokens: int, extra: dict, t0: float) -> list[RequestResult]:
    messages = [{"role": "system", "content": conversation.system}] if conversation.system \
        else []
    results = []
    for turn, user in enumerate(conversation.user_turns):
        messages.append({"role": "user", "content": user})
        start = time.perf_counter() - t0
        try:
            ttft, latency, usage, text = await chat(connection, messages, max_tokens, extra)
        except REQUEST_ERRORS as error:
            # Counted and reported; the conversation cannot go on without this reply.
            results.append(RequestResult(index, turn, start, 0.0, 0.0, 0, 0, None, "",
                                         f"{type(error).__name__}: {error}"))
            break
        messages.append({"role": "assistant", "content": text})
        details = usage.get("prompt_tokens_details") or {}
        results.append(RequestResult(
            conversation=index, turn=turn, start=start, ttft=ttft, latency=latency,
            prompt_tokens=usage.get("prompt_tokens", 0),
            completion_tokens=usage.get("completion_tokens", 0),
            cached_tokens=details.get("cached_tokens"), text=text,
        ))
    return results


class Connection:
    """One keep-alive HTTP/1.1 connection, reopened after a server closes it: a worker's
    requests, streamed chats and list requests alike.

    Not httpx: its own work is the client's share of what a run measures. On an H200 host
    it held classify lists at ~4,700 sentences/s where the same server answered this
    socket's requests at 5,700-6,000 (bench/experiments/classify-client). On the 2-core
    CPU, 64 streams opened through one httpx client had their first tokens 20-70 ms later
    and took 25% longer than over these sockets (bench/experiments/batch-decode-ramp), as
    would 64 clients of one server that each had a core of their own; 64 requests at once
    on its reused connections took 300 ms where these take 12. Bodies come sized by
    Content-Length, chunked, or (mlx-lm's HTTP/1.0 streams) up to the server's close."""

    def __init__(self, base_url: str) -> None:
        url = httpx.URL(base_url)
        self.host, self.port = url.host, url.port or 80
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        # An answer not read to its end (its reader stopped early, or failed): the socket
        # holds the rest of it, so the next request opens another.
        self._unread = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    async def post(self, path: str, body: dict) -> tuple[int, bytes]:
        """(status, body) of one POST of `body` as JSON."""
        status, pieces = await self._send(path, body)
        return status, b"".join([piece async for piece in pieces])

    async def events(self, path: str, body: dict) -> AsyncIterator[str]:
        """The `data:` payloads of one streamed POST of `body`, as they arrive; an error
        status raises StreamError with the body."""
        status, pieces = await self._send(path, body)
        if status != 200:
            raise StreamError(f"HTTP {status}: {b''.join([p async for p in pieces])[:500]!r}")
        pending = b""
        async for piece in pieces:
            *lines, pending = (pending + piece).split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode()

    async def _send(self, path: str, body: dict) -> tuple[int, AsyncIterator[bytes]]:
        if self._unread or (self._streams is not None and self._streams[0].at_eof()):
            self.close()
        data = json.dumps(body).encode()
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(data)}"
                   f"\r\n\r\n".encode() + data)
        reused = self._streams is not None
        try:
            head = await self._head(request)
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            # A server may close a kept socket whenever it is idle between answers (llama.cpp's
            # does after a stream, without saying so): a reused socket that gave no byte of an
            # answer is retried once on a new one, as HTTP clients do.
            if not reused or getattr(error, "partial", b""):
                raise
            head = await self._head(request)
        headers = dict(line.lower().split(": ", 1) for line in head[1:] if ": " in line)
        self._unread = True
        return int(head[0].split()[1]), self._body(self._streams, head[0], headers)

    async def _head(self, request: bytes) -> list[str]:
        """Send `request` (on a new socket unless one is kept) and read its answer's head."""
        if self._streams is None:
            self._streams = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), TIMEOUT.connect)
        reader, writer = self._streams
        try:
            writer.write(request)
            return (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        except BaseException:
            self.close()
            raise

    async def _body(self, streams: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                    status_line: str, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; the connection closed after it unless both
        sides keep it, and whenever the body was not read to its end (a timeout too: a
        half-read answer would be the next one's). An abandoned body finalized late
        closes its own socket only, never one opened since."""
        reader = streams[0]
        kept = status_line.startswith("HTTP/1.1") and headers.get("connection") != "close"
        try:
            if headers.get("transfer-encoding") == "chunked":
                while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                    yield (await reader.readexactly(size + 2))[:-2]
                await reader.readuntil(b"\r\n")  # the empty trailer
            elif "content-length" in headers:
                yield await reader.readexactly(int(headers["content-length"]))
            else:
                kept = False
                while piece := await reader.read(65536):
                    yield piece
            self._unread = False
        except BaseException:
            kept = False
            raise
        finally:
            if not kept and self._streams is streams:
                self.close()

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None
        self._unread = False


# What a request that did not complete raises: the connection's errors, a timeout, a
# malformed answer, the server's error.
REQUEST_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                  TimeoutError, StreamError, ValueError)


async def complete_list(connection: Connection, endpoint: str, first: int,
                        conversations: tuple[Conversation, ...], max_tokens: int,
                        extra: dict, t0: float) -> list[RequestResult]:
    """One non-streamed request to `endpoint` (`/v1/completions`, or `/v1/classify`: one
    token each) for the list of the conversations' first turns: a result per prompt, all
    timed as the whole request (TTFT = latency); the request's usage totals go on its first
    prompt's result (the response has no per-prompt usage), so sums over a run are right."""
    prompts = [c.user_turns[0] for c in conversations]
    body = ({"input": prompts} if endpoint == "/v1/classify" else
            {"prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0, **extra})
    start = time.perf_counter()
    try:
        async with asyncio.timeout(TIMEOUT.read):
            status, content = await connection.post(endpoint, body)
        if status != 200:
            raise StreamError(f"HTTP {status}: {content[:500]!r}")
        data = json.loads(content)
    except REQUEST_ERRORS as error:
        return [RequestResult(first + i, 0, start - t0, 0.0, 0.0, 0, 0, None, "",
                              f"{type(error).__name__}: {error}")
                for i in range(len(conversations))]
    latency = time.perf_counter() - start
    usage = data.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    texts = {choice["index"]: choice.get("text", choice.get("token", ""))
             for choice in data.get("choices", data.get("data", []))}
    return [RequestResult(
        conversation=first + i, turn=0, start=start - t0, ttft=latency, latency=latency,
        prompt_tokens=usage.get("prompt_tokens", 0) if i == 0 else 0,
        # /v1/classify reads one token per prompt and reports no completion tokens.
        completion_tokens=usage.get("completion_tokens", len(texts)) if i == 0 else 0,
        cached_tokens=None if cached is None else cached if i == 0 else 0,
        text=texts.get(i, ""),
    ) for i in range(len(conversations))]


async def run_workload(base_url: str, workload: Workload, extra: dict) -> WorkloadRun:
    """Conversations in list order through `concurrency` workers; turns in sequence (or,
    for a batch workload, lists of `batch` first turns per request)."""
    if workload.batch:
        return await run_batches(base_url, workload, extra)
    pending = list(enumerate(workload.conversations))[::-1]
    results: list[RequestResult] = []
    t0 = time.perf_counter()

    async def worker() -> None:
        async with Connection(base_url) as connection:
            while pending:
                index, conversation = pending.pop()
                results.extend(await run_conversation(
                    connection, index, conversation, workload.max_tokens, extra, t0))

    await asyncio.gather(*(worker() for _ in range(workload.concurrency)))
    wall = time.perf_counter() - t0
    results.sort(key=lambda r: (r.conversation, r.turn))
    return WorkloadRun(workload.name, wall, results)


async def run_batches(base_url: str, workload: Workload, extra: dict) -> WorkloadRun:
    """A batch workload's lists, through `concurrency` workers."""
    size = workload.batch
    pending = [(i, workload.conversations[i:i + size])
               for i in range(0, len(workload.conversations), size)][::-1]
    results: list[RequestResult] = []
    t0 = time.perf_counter()

    async def worker() -> None:
        async with Connection(base_url) as connection:
            while pending:
                first, conversations = pending.pop()
                results.extend(await complete_list(connection, workload.batch_endpoint,
                                                   first, conversations, workload.max_tokens,
                                                   extra, t0))

    await asyncio.gather(*(worker() for _ in range(workload.concurrency)))
    wall = time.perf_counter() - t0
    results.sort(key=lambda r: r.conversation)
    return WorkloadRun(workload.name, wall, results)
