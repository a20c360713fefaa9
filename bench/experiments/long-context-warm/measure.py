"""Warm long-context TTFT, in parts: where a warm question's time goes past its bound.

    python bench/experiments/long-context-warm/measure.py MODEL_DIR [--document 6000]

A 6,000-token document is cached, then questions of 30-60 new tokens follow it, each
with tokens not seen before. Timed, synchronized, per question (ms):
- `bare`: mlx-lm's model on the document's own KVCache (trimmed back after each): the
  forward and its argmax, the bound's prefill part;
- `bare_step`: one decode token after the document, the bound's other part;
- `rebuilt`: the same forward on a cache concatenated afresh from 2048-token pieces, as a
  radix hit assembles one, with and without `mx.clear_cache()` before it (`clear_call`:
  that call's own time), and `again`: once more right after;
- `engine`: radix-mlx's in-process engine, submit to first token, token-id prompts (no
  template, no tokenizer), in four passes: lengths not seen before with the engine's
  `mx.clear_cache` calls, the same lengths with them a no-op, new lengths with them a
  no-op, those lengths with them (each question's tokens new every time), and the time
  the engine spent in `mx.clear_cache`.
MLX's cuDNN attention is off, as the engine has it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engine.api import SamplingParams, TokenEvent
from engine.engine import Engine, EngineConfig
from engine.platform_info import apply_mlx_env_defaults

LENGTHS = (33, 41, 37, 52, 45, 60, 38, 49, 57, 35, 43, 55)
OTHER_LENGTHS = (34, 42, 39, 53, 46, 61, 36, 50, 58, 31, 44, 56)


def synced(function) -> float:
    start = time.perf_counter()
    mx.eval(function())
    return 1000 * (time.perf_counter() - start)


def bare(model, document: list[int], questions: list[list[int]]) -> dict:
    cache = make_prompt_cache(model)
    for start in range(0, len(document), 2048):
        model(mx.array([document[start:start + 2048]]), cache=cache)
        mx.eval([c.state for c in cache])
    pieces = [[(c.keys[..., a:a + 2048, :], c.values[..., a:a + 2048, :]) for c in cache]
              for a in range(0, len(document), 2048)]
    mx.eval(pieces)

    def forward(tokens, on):
        return lambda: model(mx.array([tokens]), cache=on)[:, -1].argmax(-1)

    def rebuilt(tokens, clear):
        if clear:
            start = time.perf_counter()
            mx.clear_cache()
            out["clear_call"].append(1000 * (time.perf_counter() - start))
        fresh = []
        for layer in range(len(cache)):
            c = KVCache()
            keys = mx.concatenate([p[layer][0] for p in pieces], axis=2)
            values = mx.concatenate([p[layer][1] for p in pieces], axis=2)
            c.update_and_fetch(keys, values)
            fresh.append(c)
        return synced(forward(tokens, fresh))

    out: dict[str, list[float]] = {"bare": [], "bare_step": [], "rebuilt": [],
                                   "rebuilt_cleared": [], "clear_call": [], "again": []}
    for tokens in questions:
        out["bare"].append(synced(forward(tokens, cache)))
        for c in cache:
            c.trim(len(tokens))
        out["bare_step"].append(synced(forward(tokens[:1], cache)))
        for c in cache:
            c.trim(1)
        out["rebuilt"].append(rebuilt(tokens, False))
        out["rebuilt_cleared"].append(rebuilt(tokens, True))
        out["again"].append(rebuilt(tokens, False))
    return out


async def first_token(engine: Engine, tokens: list[int]) -> float:
    start = time.perf_counter()
    async for event in engine.submit(tokens, SamplingParams(max_tokens=1, temperature=0.0)):
        if isinstance(event, TokenEvent):
            return 1000 * (time.perf_counter() - start)
    raise RuntimeError("no token")


def engine_run(model_dir: str, document: list[int], rng: random.Random) -> dict:
    engine = Engine(EngineConfig(model=model_dir, disk_cache_bytes=0))
    engine.start()
    engine.wait_ready()
    clear, clearing = mx.clear_cache, [True]
    spent: dict[str, list[float]] = {}

    def timed_clear(name):
        def call():
            if clearing[0]:
                start = time.perf_counter()
                clear()
                spent.setdefault(name, []).append(1000 * (time.perf_counter() - start))
        return call

    def question(n):
        return [rng.randrange(1000, 40000) for _ in range(n)]

    out: dict[str, list[float]] = {}
    out["engine_cold"] = [asyncio.run(first_token(engine, document + question(40)))]
    passes = (("engine_new_clear", LENGTHS, True), ("engine_seen_noclear", LENGTHS, False),
              ("engine_new_noclear", OTHER_LENGTHS, False),
              ("engine_seen_clear", OTHER_LENGTHS, True))
    try:
        for name, lengths, clearing[0] in passes:
            mx.clear_cache = timed_clear(name)
            out[name] = [asyncio.run(first_token(engine, document + question(n)))
                         for n in lengths]
    finally:
        mx.clear_cache = clear
    out.update({f"clear_calls_{name}": times for name, times in spent.items()})
    engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--document", type=int, default=6000)
    args = parser.parse_args()
    apply_mlx_env_defaults()
    rng = random.Random(0)
    model, _ = load(args.model)
    vocab = model.args.vocab_size
    document = [rng.randrange(1000, vocab - 2) for _ in range(args.document)]
    questions = [[rng.randrange(1000, vocab - 2) for _ in range(n)] for n in LENGTHS]
    results = bare(model, document, questions)
    del model
    results.update(engine_run(args.model, document, rng))
    print(json.dumps({"device": str(mx.default_device()), "document": args.document,
                      "lengths": LENGTHS,
                      "median_ms": {k: round(statistics.median(v), 2) for k, v in results.items()},
                      "sum_ms": {k: round(sum(v), 1) for k, v in results.items()},
                      "ms": {k: [round(x, 2) for x in v] for k, v in results.items()}}))


if __name__ == "__main__":
    main()
