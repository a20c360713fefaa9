"""Speculative decoding in process, on any model (random weights included): the mechanism's
speed where drafts are all accepted (a request repeated: the radix tree drafts the first
one's output) and its cost where none are (new prompts, mode auto), against bare
`mlx_lm.stream_generate` and the engine with speculation off. Greedy, EOS ignored.

    python bench/experiments/speculation-engine/spec_engine.py MODEL_DIR [--tokens 256]
        [--prompt-tokens 512] [--streams 16] [--stream-tokens 128] [--passes 1]

Prints one JSON object. The repeated request stands for an agent re-sending a tool call or
a file it wrote before; on random weights nothing else repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import mlx.core as mx
from mlx_lm import load, stream_generate

from engine.api import EngineConfig, Finish, SamplingParams, SpeculationConfig, TokenEvent
from engine.engine import Engine


async def decode(engine: Engine, prompt: list[int], tokens: int, mode: str) -> dict:
    stream = engine.submit(prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                  ignore_eos=True, speculation=mode))
    times, out = [], []
    async for event in stream:
        if isinstance(event, TokenEvent):
            times.append(time.perf_counter())
            out.append(event.token)
        elif isinstance(event, Finish):
            return {"tok_s": (len(times) - 1) / (times[-1] - times[0]), "tokens": out,
                    "drafted": event.draft_tokens, "accepted": event.accepted_draft_tokens}
    raise AssertionError("no Finish")


async def streams(engine: Engine, prompts: list[list[int]], tokens: int, mode: str) -> dict:
    started = time.perf_counter()
    runs = await asyncio.gather(*(decode(engine, p, tokens, mode) for p in prompts))
    wall = time.perf_counter() - started
    return {"output_tok_s": sum(len(r["tokens"]) for r in runs) / wall,
            "tokens": [r["tokens"] for r in runs],
            "accepted": sum(r["accepted"] for r in runs),
            "drafted": sum(r["drafted"] for r in runs)}


def bare(path: str, prompt: list[int], tokens: int) -> dict:
    model, tokenizer = load(path)
    for _ in stream_generate(model, tokenizer, prompt, max_tokens=8):
        pass
    times = []
    for _ in stream_generate(model, tokenizer, prompt, max_tokens=tokens):
        times.append(time.perf_counter())
    return {"tok_s": (len(times) - 1) / (times[-1] - times[0])}


async def measure(args) -> dict:
    rng = random.Random(0)
    engine = Engine(EngineConfig(model=args.model, speculation=SpeculationConfig(
        mode="off", max_draft=args.max_draft)))
    engine.start()
    assert engine.wait_ready(600) == "ready", engine.error
    vocab = 2000
    prompt = lambda: [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
    result: dict = {"device": str(mx.default_device()), "args": vars(args)}
    repeated = prompt()
    await decode(engine, repeated, args.tokens, "off")  # warm-up; its output goes to the tree
    off = await decode(engine, repeated, args.tokens, "off")
    on = await decode(engine, repeated, args.tokens, "on")
    result["repeated"] = {"off": off["tok_s"], "on": on["tok_s"],
                          "ratio": on["tok_s"] / off["tok_s"],
                          "accepted": on["accepted"], "drafted": on["drafted"],
                          "same": on["tokens"] == off["tokens"]}
    fresh_off = await decode(engine, prompt(), args.tokens, "off")
    fresh_auto = await decode(engine, prompt(), args.tokens, "auto")
    result["fresh"] = {"off": fresh_off["tok_s"], "auto": fresh_auto["tok_s"],
                       "ratio": fresh_auto["tok_s"] / fresh_off["tok_s"],
                       "drafted": fresh_auto["drafted"], "accepted": fresh_auto["accepted"]}
    many = [prompt() for _ in range(args.streams)]
    await streams(engine, many, args.stream_tokens, "off")  # into the tree
    s_off = await streams(engine, many, args.stream_tokens, "off")
    s_on = await streams(engine, many, args.stream_tokens, "on")
    # Later passes of the same verify shapes: what the first pass spent compiling kernels.
    again = [await streams(engine, many, args.stream_tokens, "on")
             for _ in range(args.passes - 1)]
    fresh = [prompt() for _ in range(args.streams)]
    s_fresh_off = await streams(engine, fresh, args.stream_tokens, "off")
    s_fresh_auto = await streams(engine, [prompt() for _ in range(args.streams)],
                                 args.stream_tokens, "auto")
    result["streams_repeated"] = {"off": s_off["output_tok_s"], "on": s_on["output_tok_s"],
                                  "ratio": s_on["output_tok_s"] / s_off["output_tok_s"],
                                  "same": s_on["tokens"] == s_off["tokens"],
                                  "accepted": s_on["accepted"], "drafted": s_on["drafted"],
                                  "later_passes_on": [r["output_tok_s"] for r in again]}
    result["streams_fresh"] = {"off": s_fresh_off["output_tok_s"],
                               "auto": s_fresh_auto["output_tok_s"],
                               "ratio": s_fresh_auto["output_tok_s"] / s_fresh_off["output_tok_s"],
                               "drafted": s_fresh_auto["drafted"]}
    engine.shutdown()
    result["mlx_lm"] = bare(args.model, repeated, args.tokens)
    result["repeated"]["vs_mlx_lm"] = on["tok_s"] / result["mlx_lm"]["tok_s"]
    result["repeated"]["off_vs_mlx_lm"] = off["tok_s"] / result["mlx_lm"]["tok_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--max-draft", type=int, default=8)
    parser.add_argument("--passes", type=int, default=1,
                        help="run the 16 repeated streams with speculation on this often")
    print(json.dumps(asyncio.run(measure(parser.parse_args()))))


if __name__ == "__main__":
    main()
