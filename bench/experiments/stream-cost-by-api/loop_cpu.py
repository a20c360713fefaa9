"""The asyncio loop's CPU per streamed token, by API: chat completions, text completions
and completions on token ids (bench.batch_parity's server path), on one running server.

    python loop_cpu.py PID URL MODEL [REPEATS]

PID is the server's process (its main thread runs the loop). Each repeat sends, per API,
64 concurrent streams of 33 tokens and then of 1 (ignore_eos, greedy); the loop's CPU
(`bench.server_cpu.cpu_clocks`) of the first run less the second's, over the 32 extra
tokens a stream, is the cost of a streamed token. bench.server_cpu measures the same on
chat alone. Prints a line a run and the medians as JSON.
"""

import asyncio
import json
import statistics
import sys
from collections.abc import Callable

import httpx

from bench.server_cpu import cpu_clocks

STREAMS = 64
PROMPT = "tell me a story about the sea and the ships that sail on it"


def request(api: str, model: str, index: int, max_tokens: int) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True}
    if api == "chat":
        return "/v1/chat/completions", body | {
            "messages": [{"role": "user", "content": f"request {index}: {PROMPT}"}]}
    if api == "text":
        return "/v1/completions", body | {"prompt": f"request {index}: {PROMPT}"}
    return "/v1/completions", body | {"prompt": [100 + index, *range(200, 230)]}


async def stream(client: httpx.AsyncClient, url: str, path: str, body: dict) -> None:
    async with client.stream("POST", url + path, json=body) as response:
        response.raise_for_status()
        async for _ in response.aiter_lines():
            pass


async def loop_cpu(client: httpx.AsyncClient, clocks: Callable[[], dict[str, float]],
                   url: str, model: str, api: str, max_tokens: int) -> float:
    before = clocks()["loop"]
    await asyncio.gather(*(stream(client, url, *request(api, model, i, max_tokens))
                           for i in range(STREAMS)))
    return clocks()["loop"] - before


async def main() -> None:
    clocks, url, model = cpu_clocks(int(sys.argv[1])), sys.argv[2], sys.argv[3]
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    per_token: dict[str, list[float]] = {"chat": [], "text": [], "ids": []}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        await loop_cpu(client, clocks, url, model, "chat", 4)  # warm-up
        for repeat in range(repeats):
            for api, runs in per_token.items():
                long = await loop_cpu(client, clocks, url, model, api, 33)
                short = await loop_cpu(client, clocks, url, model, api, 1)
                runs.append(1e6 * (long - short) / (32 * STREAMS))
                print(f"repeat {repeat} {api}: {runs[-1]:.1f} us a token", flush=True)
    print(json.dumps({"loop_us_per_token": {api: round(statistics.median(runs), 1)
                                            for api, runs in per_token.items()},
                      "runs": per_token}))


asyncio.run(main())
