"""Structured output: constrained vs free decoding on one engine, and grammar compile times.

    python -m bench.structured MODEL_DIR --prompt-tokens 64 --max-tokens 128 --repeats 2 \
        [--out bench/results/<hardware>/<model>-structured]

Runs in its own process (started by the benchmark after the servers have stopped, like
bench.raw_decode) on the engine itself, so both kinds of request share one model, one
batch loop and one process, and only the grammar differs; HTTP would add the same cost to
both. At batch 1 and 16, the same prompts decode free (ignore_eos) and under a JSON Schema
that cannot complete within max_tokens (a list of at least 64 records), alternating,
`repeats` times each. A batch's rate is its steady state: tokens emitted while every
stream of the batch was decoding, over that window (the whole span if they never all
decode at once). Prints one JSON object; with --out,
also writes it as results.json and results.md there (`make bench` runs it without).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from bench import hardware
from bench.report import structured_markdown
from bench.workloads import TextSource
from engine.api import Finish, SamplingParams
from engine.constraints import FunctionTool, JsonAnswer, json_object, json_schema, tool_calls
from engine.engine import Engine, EngineConfig
from engine.grammar import Grammars

BATCH_SIZES = (1, 16)
# What pydantic writes for `class Record(BaseModel): id: int; name: str; score: float;
# tags: list[Literal["new", "open", "closed", "urgent"]]`. (Bounded strings cost more: the
# lexer builds new states for each length, ~1-20 ms per position the first time.)
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["new", "open", "closed", "urgent"]}},
    },
    "required": ["id", "name", "score", "tags"],
    "additionalProperties": False,
}
RECORDS = {"type": "object", "properties": {
    "records": {"type": "array", "items": RECORD, "minItems": 64}},
    "required": ["records"], "additionalProperties": False}
TOOLS = [
    FunctionTool("get_weather", {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}),
    FunctionTool("search", {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}},
        "required": ["query"]}),
    FunctionTool("send_email", {"type": "object", "properties": {
        "to": {"type": "array", "items": {"type": "string"}}, "subject": {"type": "string"},
        "body": {"type": "string"}}, "required": ["to", "subject", "body"]}),
]


def compile_times(engine: Engine) -> dict:
    """Seconds to build each grammar (server side) and compile it for the model's
    tokenizer (engine side, cold), and the one-time tokenizer conversion."""
    grammars = Grammars(engine.tokenizer, engine._loaded.vocab_size)
    started = time.perf_counter()
    grammars.prepare()
    tokenizer_seconds = time.perf_counter() - started
    times = {}
    for name, build in (("json_object", json_object),
                        ("records_schema", lambda: json_schema(RECORDS, strict=True)),
                        ("tool_call_3_tools", lambda: tool_calls(TOOLS, parallel=True)),
                        # Tools beside a response_format: the calls or the answer.
                        ("tool_calls_or_records", lambda: tool_calls(
                            TOOLS, parallel=True, answer=JsonAnswer(RECORDS, strict=True)))):
        started = time.perf_counter()
        constraint = build()
        built = time.perf_counter()
        grammars.state(constraint)
        times[name] = {"build_seconds": built - started,
                       "compile_seconds": time.perf_counter() - built}
    return {"tokenizer_seconds": tokenizer_seconds, "grammars": times}


async def batch_rate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    async def stream(prompt: list[int]) -> list[float]:
        times = []
        async for event in engine.submit(prompt, params):
            if not isinstance(event, Finish):
                times.append(time.perf_counter())
        return times

    runs = await asyncio.gather(*(stream(p) for p in prompts))
    start, end = max(r[0] for r in runs), min(r[-1] for r in runs)
    if end <= start:  # outputs too short to overlap: the whole span instead
        start, end = min(r[0] for r in runs), max(r[-1] for r in runs)
    tokens = sum(start < t <= end for r in runs for t in r)
    return tokens / (end - start)


async def decode_rates(engine: Engine, source: TextSource, prompt_tokens: int,
                       max_tokens: int, repeats: int) -> dict:
    tokenizer = engine.tokenizer
    free = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                 constraint=json_schema(RECORDS, strict=True))
    rates = {}
    for batch in BATCH_SIZES:
        samples: dict[str, list[float]] = {"free": [], "constrained": []}
        for _ in range(repeats):
            for name, params in (("free", free), ("constrained", constrained)):
                # Fresh prompts each time, so no run decodes from the other's cache.
                prompts = [tokenizer.encode(source.text(prompt_tokens),
                                            special_tokens=False) for _ in range(batch)]
                samples[name].append(await batch_rate(engine, prompts, params))
        free_rate = statistics.median(samples["free"])
        constrained_rate = statistics.median(samples["constrained"])
        rates[str(batch)] = {"free_tok_s": free_rate, "constrained_tok_s": constrained_rate,
                             "ratio": constrained_rate / free_rate, "samples": samples}
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write results.json and results.md here")
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=str(args.model)))
    engine.start()
    if engine.wait_ready() != "ready":
        raise SystemExit(f"the engine did not start: {engine.error}")
    try:
        result = {"compile": compile_times(engine), "decode": asyncio.run(decode_rates(
            engine, TextSource(args.model, args.seed), args.prompt_tokens, args.max_tokens,
            args.repeats)), "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens}
    finally:
        engine.shutdown()
    print(json.dumps(result))
    if args.out:
        write(result, args.out)


def write(result: dict, out: Path) -> None:
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    hardware.write_results(out, "bench.structured", device, "Structured output", result,
                           lambda r: [f"Command: `{r['command']}`", *structured_markdown(r)])


if __name__ == "__main__":
    main()
