"""Classify passes through HTTP with two clients: the benchmark's (httpx, bench.client) and
a lean one (one keep-alive socket per worker, orjson), to see what the client's own time
per list costs the passes' rate.

    python drive.py FILE BASE_URL {httpx,lean} LISTS [LIST_SIZE]

FILE: the passes pickled by ../classify-step-parts-1b-vocab49152/drive.py's `build` (a
warm-up pass and three, 4096 sentences each). `httpx` was the benchmark's client
(`bench.client.run_batches`) when this ran; it now sends over `ListConnection`.
"""

import asyncio
import pickle
import sys
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import orjson

from bench.client import run_batches


async def lean_pass(base_url: str, lists: list[list[str]], workers: int) -> tuple[float, list[float]]:
    """Every list through `workers` keep-alive sockets: (wall seconds, latencies)."""
    url = urlsplit(base_url)
    pending = list(reversed(lists))
    latencies: list[float] = []

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        while pending:
            body = orjson.dumps({"input": pending.pop()})
            start = time.perf_counter()
            writer.write(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            data = orjson.loads(await reader.readexactly(length))
            latencies.append(time.perf_counter() - start)
            assert head.startswith(b"HTTP/1.1 200"), (head, data)
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return time.perf_counter() - t0, latencies


def main() -> None:
    workloads = pickle.loads(Path(sys.argv[1]).read_bytes())
    base_url, client, workers = sys.argv[2], sys.argv[3], int(sys.argv[4])
    size = int(sys.argv[5]) if len(sys.argv) > 5 else 64
    rates = []
    for i, workload in enumerate(workloads):
        texts = [c.user_turns[0] for c in workload.conversations]
        if client == "httpx":
            run = asyncio.run(run_batches(base_url, replace(workload, concurrency=workers,
                                                            batch=size), {}))
            wall = run.wall_seconds
            lat = sorted(r.latency for r in run.requests[::size])
        else:
            lists = [texts[j:j + size] for j in range(0, len(texts), size)]
            wall, lat = asyncio.run(lean_pass(base_url, lists, workers))
            lat.sort()
        if i:
            rates.append(len(texts) / wall)
        print(f"  {'warm' if i == 0 else 'pass'} {i}: {len(texts) / wall:.0f}/s, "
              f"list latency p50 {1000 * lat[len(lat) // 2]:.1f} ms", flush=True)
    print(f"{client} x{workers} lists of {size}: median {sorted(rates)[len(rates) // 2]:.0f}/s")


if __name__ == "__main__":
    main()
