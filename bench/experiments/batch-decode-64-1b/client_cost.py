"""What the benchmark's own client (bench/client.py) costs per streamed token: a fake
OpenAI server in another process streams 64 chats of 128 one-token chunks as fast as it
can, and the client process's CPU time is read around `run_workload`. If the client needs
more CPU per token than a server step gives it, the batch_decode workload measures the
client, not the server.

    python bench/experiments/batch-decode-64-1b/client_cost.py [--streams 64] [--tokens 128]
"""

import argparse
import asyncio
import json
import multiprocessing
import socket
import time

import uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from bench.client import run_workload
from bench.workloads import Conversation, Workload

CHUNK = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk",
         "created": 1700000000, "model": "llama-1b-vocab49152",
         "choices": [{"index": 0, "delta": {"content": " word"}, "logprobs": None,
                      "finish_reason": None}]}


def serve(port: int, tokens: int) -> None:
    async def chat(request):
        await request.body()

        async def events():
            for _ in range(tokens):
                yield f"data: {json.dumps(CHUNK)}\n\n"
                await asyncio.sleep(0)
            usage = {"prompt_tokens": 64, "completion_tokens": tokens, "total_tokens": 64 + tokens}
            yield f"data: {json.dumps({**CHUNK, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = multiprocessing.Process(target=serve, args=(port, args.tokens), daemon=True)
    server.start()
    time.sleep(2.0)
    workload = Workload(name="batch_decode", max_tokens=args.tokens,
                        concurrency=args.streams,
                        conversations=tuple(Conversation(system="", user_turns=("hi",))
                                            for _ in range(args.streams)))
    for _ in range(args.repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        run = asyncio.run(run_workload(f"http://127.0.0.1:{port}", workload, {}))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        tokens = sum(r.completion_tokens for r in run.requests)
        print(json.dumps({"tokens": tokens, "client_cpu_s": round(cpu, 3),
                          "wall_s": round(wall, 3),
                          "client_cpu_us_per_token": round(1e6 * cpu / tokens, 1)}))
    server.terminate()


if __name__ == "__main__":
    main()
