"""What binding a strict tool's calls under plain "auto" costs a reply that calls nothing.

    python bench/experiments/strict-auto-grammar/measure.py URL [--streams 16] [--rounds 3]

Since 0c3abe4 a chat that offers a tool marked `strict` (as OpenAI's Agents SDK marks every
function tool) under tool_choice "auto" is decoded under a grammar: free text that may end
in calls. Against a running server, `streams` such chats at once, greedy, 128 tokens each
(`ignore_eos`), the same tools with `strict` true and false in alternating rounds (the
prompt is the same either way, so both hit the same cached prefix). Prints output tok/s
per round and mode with the engine's steps, their mean time and their thread's CPU time
per step (from /metrics), and the medians' ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
    "set_thermostat": {"type": "object", "properties": {
        "degrees": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["degrees", "unit"], "additionalProperties": False},
}
ASKS = ["Write a short poem about the sea.", "Explain how a bicycle works.",
        "Tell me a story about a dragon.", "Describe your favourite city."]


async def one(client: httpx.AsyncClient, url: str, model: str, ask: str, strict: bool) -> int:
    tools = [{"type": "function", "function": {"name": name, "description": name,
                                               "parameters": schema, "strict": strict}}
             for name, schema in TOOLS.items()]
    response = await client.post(f"{url}/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": ask}], "tools": tools,
        "max_tokens": 128, "temperature": 0, "ignore_eos": True})
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


STEP_METRICS = ("radix_mlx_engine_steps_total", "radix_mlx_engine_step_seconds_total",
                "radix_mlx_engine_step_cpu_seconds_total")


async def step_counters(client: httpx.AsyncClient, url: str) -> list[float]:
    """The engine's steps, their seconds and their thread's CPU seconds so far."""
    text = (await client.get(f"{url}/metrics")).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith(STEP_METRICS)}
    return [values[name] for name in STEP_METRICS]


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        rates: dict[str, list[float]] = {"strict": [], "loose": []}
        for round_ in range(args.rounds + 1):  # the first round warms both up
            for strict in ((True, False) if round_ % 2 else (False, True)):
                before = await step_counters(client, args.url)
                started = time.perf_counter()
                tokens = await asyncio.gather(*[
                    one(client, args.url, model, ASKS[i % len(ASKS)], strict)
                    for i in range(args.streams)])
                rate = sum(tokens) / (time.perf_counter() - started)
                steps, seconds, cpu = (after - first for after, first in zip(
                    await step_counters(client, args.url), before, strict=True))
                if round_:
                    rates["strict" if strict else "loose"].append(rate)
                print(f"round {round_} strict={strict}: {rate:.0f} tok/s, {steps:.0f} steps "
                      f"of {1e3 * seconds / steps:.2f} ms ({1e3 * cpu / steps:.2f} ms CPU)",
                      flush=True)
    medians = {mode: statistics.median(values) for mode, values in rates.items()}
    print(json.dumps({"rates": rates, "medians": medians,
                      "strict_over_loose": medians["strict"] / medians["loose"]}))


asyncio.run(main())
