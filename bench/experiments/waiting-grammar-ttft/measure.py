"""The first token of a Responses request whose tools leave `strict` unsaid.

    python bench/experiments/waiting-grammar-ttft/measure.py URL [--requests 16] [--rounds 2]

Such tools are strict by default (as OpenAI's Responses API has them), so their calls are
bound by a grammar that waits for the call's marker. Against a running server: five tools,
one short input, one output token, greedy, streamed; rounds alternate `strict: false` and
`strict` unsaid (both prompts are cached after their first request, which is not counted).
Prints each round's median time to the first output event, measured by the client.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

PARAMETERS = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"},
    "unit": {"type": "string", "enum": ["c", "f"]}}}


def first_event_seconds(client: httpx.Client, model: str, strict: dict) -> float:
    tools = [{"type": "function", "name": f"tool_{i}", "description": "does a thing",
              "parameters": PARAMETERS, **strict} for i in range(5)]
    body = {"model": model, "input": "Say hello.", "tools": tools, "max_output_tokens": 1,
            "temperature": 0, "stream": True}
    started = time.perf_counter()
    with client.stream("POST", "/v1/responses", json=body) as response:
        for line in response.iter_lines():
            if "output_text.delta" in line or "function_call_arguments" in line \
                    or "response.completed" in line or "response.incomplete" in line:
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without output")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with httpx.Client(base_url=args.url, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for round_ in range(args.rounds):
            for label, strict in (("strict: false", {"strict": False}), ("unsaid", {})):
                times = [first_event_seconds(client, model, strict)
                         for _ in range(args.requests + 1)][1:]
                print(f"round {round_ + 1} {label:>13}: first event median "
                      f"{statistics.median(times) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
