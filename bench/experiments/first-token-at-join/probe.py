"""TTFT of short chats sent one by one while 8 long streams decode (issue 36).

    python probe.py BASE_URL [PROBES]

Eight 300-token streams start, then PROBES chats of one new line each (2 tokens out) go
one at a time; prints their TTFT p50. A probe's prompt is computed in one step; before
805aa8f it joined the decode batch at the next, and its TTFT held that joining step.
"""

import asyncio
import json
import random
import statistics
import sys
import time

import httpx


async def stream(client: httpx.AsyncClient, base: str, content: str, max_tokens: int) -> float:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    started, first = time.perf_counter(), None
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if first is None and line.startswith("data:") and "[DONE]" not in line:
                for choice in json.loads(line[5:]).get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        first = time.perf_counter() - started
    return first


async def main(base: str, probes: int) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        load = [asyncio.create_task(stream(client, base, f"Write a long story about robot {i}.",
                                           300)) for i in range(8)]
        await asyncio.sleep(4)
        ttfts = []
        for _ in range(probes):
            ttfts.append(await stream(client, base, f"Say hi to person number "
                                      f"{random.randint(0, 10**9)}.", 2))
            await asyncio.sleep(0.3)
        for task in load:
            task.cancel()
    print(f"TTFT p50 {1000 * statistics.median(ttfts):.0f} ms, "
          f"all {[round(1000 * t) for t in ttfts]}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 12))
