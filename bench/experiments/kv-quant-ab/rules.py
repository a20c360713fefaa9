"""Which rule for a forward's own tokens on a quantized server: attend over each other as
computed ("exact self", everything earlier as kept) or as kept, like every other token
("as kept")? For each, on 12 chats behind one 200-token system prompt at --kv-bits 8 and
4: how many hits (system prompt cached) answer as the same server's cold prompt, and how
many as the unquantized model. In process, the rule swapped on RoundedWrites.

    python bench/experiments/kv-quant-ab/rules.py MODEL_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import mlx.core as mx

from bench.kv_quant import identity_chats
from engine import mlx_lm_internals
from engine.api import EngineConfig, SamplingParams
from engine.engine import Engine

PROMPTS, OUTPUT_TOKENS = 12, 24


def as_kept(self, keys, values):
    return self._layer.update_and_fetch(self._round(keys), self._round(values))


async def answer(engine: Engine, prompt: list[int]) -> list[int]:
    stream = engine.submit(prompt, SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0,
                                                  ignore_eos=True))
    return [event.token async for event in stream if hasattr(event, "token")]


async def answers(engine: Engine, prompts: list[list[int]], cold: bool) -> list[list[int]]:
    found = []
    for prompt in prompts:
        if cold:
            await asyncio.wrap_future(engine.clear_cache())
        found.append(await answer(engine, prompt))
    return found


async def main(model: str) -> None:
    exact_self = mlx_lm_internals.RoundedWrites.update_and_fetch
    results = {}
    base = None
    for bits in (None, 8, 4):
        engine = Engine(EngineConfig(model=model, kv_bits=bits, cache_bytes=1 << 30))
        engine.start()
        assert engine.wait_ready(300) == "ready", engine.error
        prompts = [engine.tokenizer.chat_prompt(chat)
                   for chat in identity_chats(Path(model), 0)[:PROMPTS]]
        for rule, method in (("exact self", exact_self), ("as kept", as_kept)):
            mlx_lm_internals.RoundedWrites.update_and_fetch = method
            cold = await answers(engine, prompts, cold=True)
            if bits is None:
                base = cold
                break
            await asyncio.wrap_future(engine.clear_cache())
            await answer(engine, prompts[0])  # caches the system prompt
            hits = await answers(engine, prompts, cold=False)
            results[f"{bits} bits, {rule}"] = {
                "hit_equals_cold": sum(h == c for h, c in zip(hits, cold)),
                "cold_equals_unquantized": sum(c == b for c, b in zip(cold, base)),
                "hit_equals_unquantized": sum(h == b for h, b in zip(hits, base))}
            print(rule, bits, results[f"{bits} bits, {rule}"], file=sys.stderr, flush=True)
        engine.shutdown()
    mlx_lm_internals.RoundedWrites.update_and_fetch = exact_self
    print(json.dumps({"prompts": PROMPTS, "output_tokens": OUTPUT_TOKENS, **results},
                     indent=2))


if __name__ == "__main__":
    mx.random.seed(0)
    asyncio.run(main(sys.argv[1]))
