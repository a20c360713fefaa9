"""Bursts of 64 one-token streamed chat requests, for a profiler attached to the server
(`py-spy record --pid PID --rate 200 --format raw -o OUT --duration 60`).

    python bursts.py URL MODEL BURSTS
"""

import asyncio
import sys

import httpx


async def one(client: httpx.AsyncClient, url: str, model: str, index: int) -> None:
    body = {"model": model, "max_tokens": 1, "stream": True, "temperature": 0,
            "messages": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": f"request {index}: tell me a story "
                                                     f"about the sea, number {index * 7}"}]}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for _ in response.aiter_lines():
            pass


async def main() -> None:
    url, model, bursts = sys.argv[1], sys.argv[2], int(sys.argv[3])
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        for burst in range(bursts):
            await asyncio.gather(*(one(client, url, model, i + 64 * burst) for i in range(64)))


asyncio.run(main())
