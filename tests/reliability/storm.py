"""A storm of concurrent clients, well- and ill-behaved, against one server: the bounded
test and `make soak` run the same one, for a few hundred requests or for minutes.

Every request has a kind, and every kind a set of answers it may get; anything else
(another status, a transport error, a stream without its end) is recorded as unexpected.
Repeatable requests (greedy, or sampled from a seed; some with penalties or a repetition
penalty) come from a small pool, so the same body runs many times, concurrently, beside
any neighbours and under eviction; afterwards each is run alone and must give the same
text.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import httpx

from tests.reliability.support import (
    AUTH,
    CACHE_BYTES,
    MAX_BODY_BYTES,
    Outcome,
    call,
)
from tests.server.support import ServerProcess, wait_idle

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CORPUS = resources.files("engine").joinpath("demo_corpus/prose.txt").read_text()
SENTENCES = [s.strip() + "." for s in CORPUS.replace("\n", " ").split(".") if s.strip()]

# Kind -> relative frequency. Repeatable requests are checked against a run alone afterwards.
WEIGHTS = {
    "repeatable": 30, "sampled": 8, "disconnect mid-stream": 10, "abandon while waiting": 6,
    "malformed body": 8, "oversized body": 4, "wrong key": 6, "beyond context": 5,
    "failing forward": 3, "forced tool call": 4, "structured output": 4,
}
# What makes an answer repeatable, beyond the pool's greedy defaults: a seed (each row's
# noise comes from its seed and output index alone), penalties and a repetition penalty
# (applied to a batch's rows together: engine/sampling.py), and the two at once.
REPEATABLE = (
    {}, {"temperature": 0.8, "top_p": 0.9, "seed": 7},
    {"frequency_penalty": 0.6, "presence_penalty": 0.4}, {"repetition_penalty": 1.3},
    {"temperature": 1.0, "top_k": 20, "min_p": 0.02, "seed": 11, "frequency_penalty": 0.5},
)
# What agent frameworks send: a forced call of a tool, an answer in a JSON schema.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                                  "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}
# After the storm MLX's active memory may exceed its baseline (taken after warm-up and one
# request) by what the radix tree may hold beyond that one request's KV, its budget, plus
# room for MLX's own small allocations that come and go (a few MiB at most here).
MEMORY_SLACK = CACHE_BYTES + 8 * 2**20
BAD_INPUTS = ("malformed body", "oversized body", "wrong key", "beyond context")
MALFORMED = [
    b'{"messages": [', b"[1, 2]", b'{"prompt": 5}', b"\xff\xfe not json",
    b'{"messages": [{"role": "robot", "content": "x"}]}', b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "n": "2"}', b'{"prompt": "x", "logit_bias": {"a": 1}}',
    b'{"prompt": "x", "stream_options": {"include_usage": true}}', b'{"prompt": []}',
    b'{"prompt": [1, 99999999]}', b'{"messages": [], "max_tokens": 2}',
]


@dataclass(frozen=True)
class Spec:
    """One request to send: its kind, where, what, and how the client behaves."""

    kind: str
    path: str
    body: dict[str, Any] | None = None
    raw: bytes | None = None  # sent as is instead of `body`
    headers: dict[str, str] = field(default_factory=lambda: AUTH)
    read_events: int = 0  # disconnect mid-stream after this many lines
    patience: float = 0.0  # abandon a whole response after this many seconds


@dataclass
class Tally:
    sent: Counter[str] = field(default_factory=Counter)
    answers: Counter[tuple[str, int]] = field(default_factory=Counter)
    disconnects: int = 0
    unexpected: list[str] = field(default_factory=list)
    repeatable: dict[str, set[str]] = field(default_factory=dict)  # body (JSON) -> texts seen
    latencies: list[float] = field(default_factory=list)

    @property
    def bad_inputs(self) -> int:
        return sum(self.sent[kind] for kind in BAD_INPUTS)

    @property
    def failures_survived(self) -> int:
        return self.sent["failing forward"]


class Workload:
    """Deterministic requests for a seed; `fault` is the token id that fails a forward."""

    def __init__(self, seed: int, fault: int, context: int, system_sentences: int = 6) -> None:
        self.rng = random.Random(seed)
        self.fault, self.context = fault, context
        self.no_fault = {"logit_bias": {str(fault): -100}}
        systems = [" ".join(self.rng.choices(SENTENCES, k=system_sentences)) for _ in range(4)]
        self.pool = [self._repeatable(systems[i % 4], i) for i in range(24)]

    def _repeatable(self, system: str, i: int) -> tuple[str, dict[str, Any]]:
        question = self.rng.choice(SENTENCES)
        body = {"max_tokens": self.rng.randint(4, 24), "temperature": 0,
                "stream": i % 2 == 0, **self.no_fault, **REPEATABLE[i % len(REPEATABLE)]}
        if i % 3:
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": question}]
            return CHAT, {"messages": messages, **body}
        return COMPLETIONS, {"prompt": f"{system} {question}", **body}

    def specs(self, count: int | None = None) -> Iterator[Spec]:
        """`count` requests, or an endless stream of them."""
        kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
        sent = 0
        while count is None or sent < count:
            sent += 1
            yield self.spec(self.rng.choices(kinds, weights)[0])

    def spec(self, kind: str) -> Spec:
        rng = self.rng
        text = " ".join(rng.sample(SENTENCES, rng.randint(1, 4)))
        if kind == "repeatable":
            path, body = rng.choice(self.pool)
            return Spec(kind, path, body)
        if kind == "sampled":
            return Spec(kind, COMPLETIONS, {
                "prompt": text, "max_tokens": rng.randint(4, 32), "temperature": 0.9,
                "top_p": 0.9, "stream": rng.random() < 0.5, **self.no_fault})
        if kind == "disconnect mid-stream":
            return Spec(kind, rng.choice((CHAT, COMPLETIONS)), self._long(text, stream=True),
                        read_events=rng.randint(1, 6))
        if kind == "abandon while waiting":
            return Spec(kind, COMPLETIONS, self._long(text, stream=False),
                        patience=rng.uniform(0.05, 0.5))
        if kind == "malformed body":
            return Spec(kind, rng.choice((CHAT, COMPLETIONS)), raw=rng.choice(MALFORMED))
        if kind == "oversized body":
            padding = " " * (MAX_BODY_BYTES + rng.randint(1, 4096))
            return Spec(kind, COMPLETIONS, raw=b'{"prompt": "' + padding.encode() + b'"}')
        if kind == "wrong key":
            key = rng.choice(("", "Bearer nope", "Bearer " + "x" * 40, "Basic abc"))
            return Spec(kind, rng.choice((CHAT, COMPLETIONS)), {"prompt": text, "max_tokens": 2},
                        headers={"Authorization": key} if key else {})
        if kind == "beyond context":
            if rng.random() < 0.5:
                return Spec(kind, COMPLETIONS, {"prompt": text, "max_tokens": self.context})
            prompt = [self._token() for _ in range(self.context)]  # ~40 KiB of JSON
            return Spec(kind, COMPLETIONS, {"prompt": prompt, "max_tokens": 1})
        if kind == "forced tool call":
            return Spec(kind, CHAT, {
                "messages": [{"role": "user", "content": f"What is the weather? {text}"}],
                "tools": [WEATHER_TOOL], "tool_choice": "required", "max_tokens": 48,
                "temperature": 0, "stream": rng.random() < 0.5, **self.no_fault})
        if kind == "structured output":
            return Spec(kind, CHAT, {
                "messages": [{"role": "user", "content": f"Invent a person. {text}"}],
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "person", "schema": PERSON_SCHEMA, "strict": True}},
                "max_tokens": 48, "temperature": 0, "stream": rng.random() < 0.5,
                **self.no_fault})
        if kind == "failing forward":
            prompt = [self._token() for _ in range(rng.randint(2, 40))]
            prompt.insert(rng.randrange(len(prompt)), self.fault)
            return Spec(kind, COMPLETIONS, {"prompt": prompt, "max_tokens": 4,
                                            "stream": rng.random() < 0.5})
        raise ValueError(kind)

    def _token(self) -> int:
        """A token id of the tiny model's vocabulary, never the fault token."""
        token = self.rng.randrange(5, 2000)
        return token if token != self.fault else token + 1

    def _long(self, text: str, stream: bool) -> dict[str, Any]:
        return {"prompt": text, "max_tokens": self.rng.randint(64, 200), "ignore_eos": True,
                "stream": stream, **self.no_fault}


async def storm(url: str, specs: Iterator[Spec], concurrency: int,
                tally: Tally | None = None) -> Tally:
    """Send every spec, `concurrency` at a time; the tally of what came back (added to
    `tally` if given)."""
    tally = tally if tally is not None else Tally()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            for spec in specs:  # one shared iterator: each spec goes to one worker
                tally.sent[spec.kind] += 1
                try:
                    await _send(client, spec, tally)
                except (httpx.HTTPError, json.JSONDecodeError, KeyError) as error:
                    tally.unexpected.append(f"{spec.kind}: {error!r}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


async def _send(client: httpx.AsyncClient, spec: Spec, tally: Tally) -> None:
    started = time.perf_counter()
    if spec.read_events:
        async with client.stream("POST", spec.path, json=spec.body,
                                 headers=spec.headers) as response:
            async for _ in _first(response.aiter_lines(), spec.read_events):
                pass
        tally.disconnects += 1  # leaving the block closes the connection mid-stream
        return
    if spec.patience:
        try:
            outcome = await asyncio.wait_for(call(client, spec.path, spec.body), spec.patience)
        except TimeoutError:
            tally.disconnects += 1
            return
    elif spec.raw is not None:
        response = await client.post(spec.path, content=spec.raw, headers={
            **spec.headers, "Content-Type": "application/json"})
        outcome = Outcome(response.status_code, error=response.json().get("error"))
    else:
        outcome = await call(client, spec.path, spec.body, spec.headers)
    tally.answers[(spec.kind, outcome.status)] += 1
    problem = _check(spec, outcome)
    if problem:
        tally.unexpected.append(f"{spec.kind} {spec.path}: {problem}")
        return
    if outcome.status == 200 and outcome.error is None:
        tally.latencies.append(time.perf_counter() - started)
        if spec.kind == "repeatable":
            key = json.dumps([spec.path, spec.body], sort_keys=True)
            tally.repeatable.setdefault(key, set()).add(outcome.text)


async def _first(lines: AsyncIterator[str], count: int) -> AsyncIterator[str]:
    seen = 0
    async for line in lines:
        yield line
        seen += line.startswith("data:")
        if seen >= count:
            return


def _check(spec: Spec, outcome: Outcome) -> str | None:
    """Why `outcome` is not an answer `spec` may get, or None."""
    status, error = outcome.status, outcome.error
    if status == 429 and spec.kind in ("repeatable", "sampled", "abandon while waiting",
                                       "forced tool call", "structured output",
                                       "failing forward"):
        return None  # the queue was full: refused whole, with Retry-After, never dropped
    expected = {
        "malformed body": (400, "invalid_request"), "oversized body": (413, "request_too_large"),
        "wrong key": (401, "invalid_api_key"),
        "beyond context": (400, "context_length_exceeded"),
    }
    if spec.kind in expected:
        got = (status, error and error.get("code"))
        return None if got == expected[spec.kind] else f"{got} instead of {expected[spec.kind]}"
    if spec.kind == "failing forward":
        # A stream has sent its 200 already: the error comes as its last event.
        want = 200 if spec.body.get("stream") else 500
        if status == want and error is not None and error["code"] == "engine_error":
            return None
        return f"{status} {error} instead of {want} engine_error"
    if status != 200 or error is not None:
        return f"{status} {error}"
    if spec.kind in ("forced tool call", "structured output") and outcome.finish_reason != "length":
        return _check_structured(spec, outcome)
    if outcome.finish_reason not in ("stop", "length"):
        return f"ended without a finish reason: {outcome.text!r}"
    return None


def _check_structured(spec: Spec, outcome: Outcome) -> str | None:
    """A forced call names the tool and its arguments are the object its schema asks
    for; a structured answer is the schema's object. (Cut short by max_tokens, either may
    be incomplete: that answer is not checked.)"""
    if spec.kind == "forced tool call":
        if outcome.finish_reason != "tool_calls" or not outcome.tool_calls:
            return f"no tool call: {outcome.finish_reason} {outcome.text!r}"
        call = outcome.tool_calls[0]
        value, expected = json.loads(call["arguments"]), {"city"}
        if call["name"] != "get_weather":
            return f"called {call['name']!r}"
    else:
        try:
            value, expected = json.loads(outcome.text), {"name", "age"}
        except json.JSONDecodeError as error:
            return f"not JSON ({error}), finish {outcome.finish_reason}: {outcome.text!r}"
    if not isinstance(value, dict) or set(value) != expected:
        return f"not the schema's object: {value!r}"
    return None


def baseline(server: ServerProcess) -> dict[str, float]:
    """/metrics after one request (the engine warmed up before reporting ready): what the
    memory after a storm is compared with."""
    body = {"prompt": "Hello", "max_tokens": 4}
    assert httpx.post(f"{server.url}{COMPLETIONS}", json=body, headers=AUTH,
                      timeout=60).status_code == 200
    return wait_idle(server)


async def rerun_alone(url: str, tally: Tally) -> list[str]:
    """Each repeatable body run again, alone; the bodies whose storm answers differ from it."""
    mismatches = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for key, texts in sorted(tally.repeatable.items()):
            path, body = json.loads(key)
            alone = await call(client, path, body)
            if texts != {alone.text}:
                mismatches.append(f"{path} {body}: alone {alone.text!r}, in the storm {texts}")
    return mismatches


def figures(tally: Tally, before: dict[str, float], after: dict[str, float],
            seconds: float) -> str:
    """The storm in a few lines, for the soak's report."""
    mib = 2**20
    p50 = statistics.median(tally.latencies) if tally.latencies else float("nan")
    memory_before = before["radix_mlx_active_memory_bytes"] / mib
    memory_after = after["radix_mlx_active_memory_bytes"] / mib
    tree = after["radix_mlx_tree_bytes"] / mib
    budget = after["radix_mlx_tree_capacity_bytes"] / mib
    evictions = after["radix_mlx_tree_evictions_total"]
    cached = after["radix_mlx_cached_tokens_total"]
    running, waiting = after["radix_mlx_running_requests"], after["radix_mlx_queue_depth"]
    pinned = after["radix_mlx_tree_pinned_bytes"]
    return "\n".join([
        f"requests sent        {sum(tally.sent.values())} in {seconds:.0f} s",
        f"by kind              {dict(sorted(tally.sent.items()))}",
        f"answers              {dict(sorted(tally.answers.items()))}",
        f"disconnects          {tally.disconnects}",
        f"bad inputs tried     {tally.bad_inputs}",
        f"failures survived    {tally.failures_survived} failing forward passes",
        f"unexpected answers   {len(tally.unexpected)}",
        f"repeatable bodies    {len(tally.repeatable)} distinct",
        f"p50 latency          {p50 * 1000:.0f} ms (answered requests)",
        f"MLX active memory    {memory_before:.2f} MiB before, {memory_after:.2f} MiB after",
        f"radix tree           {tree:.2f} of {budget:.2f} MiB, {evictions:.0f} evictions, "
        + f"{cached:.0f} prompt tokens from the cache",
        f"engine after         running {running:.0f}, waiting {waiting:.0f}, "
        + f"pinned {pinned:.0f} bytes",
    ])
