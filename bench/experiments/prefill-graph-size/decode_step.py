"""The primitives of one single-stream decode step: bare mlx-lm's (`generate_step`'s
forward, logprobs and greedy pick) against the engine's (`Generator._decode`'s
`mx.async_eval`, caught for the first steps of one greedy request).

    python bench/experiments/prefill-graph-size/decode_step.py MODEL_DIR

On the CPU, MLX's fast ops (attention, RMS norm) decompose into more primitives than on
CUDA: compare the two lines, not the totals with a GPU's kernel count.
"""

import asyncio
import sys

import mlx.core as mx
from graph_count import line, primitives
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from engine.api import SamplingParams
from engine.engine import Engine, EngineConfig

PROMPT = list(range(3, 67))


def bare_step(model_dir: str) -> str:
    model, _ = load(model_dir)
    cache = make_prompt_cache(model)
    logits = model(mx.array(PROMPT)[None], cache=cache)[:, -1, :]
    token = mx.argmax(logits, axis=-1)
    mx.eval(token, [c.state for c in cache])
    logits = model(token[:, None], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return line("bare mlx-lm step", primitives([mx.argmax(logprobs, axis=-1), logprobs]))


def engine_steps(model_dir: str, steps: int = 4) -> list[str]:
    seen: list[str] = []
    async_eval = mx.async_eval

    def counted(*arrays):
        if len(seen) < steps:
            seen.append(line("engine step", primitives(list(arrays))))
        return async_eval(*arrays)

    mx.async_eval = counted
    engine = Engine(EngineConfig(model=model_dir))
    engine.start()
    if engine.wait_ready() != "ready":
        raise SystemExit(f"the engine did not start: {engine.error}")

    async def generate() -> None:
        async for _ in engine.submit(PROMPT, SamplingParams(max_tokens=8, temperature=0.0)):
            pass

    try:
        asyncio.run(generate())
    finally:
        engine.shutdown()
        mx.async_eval = async_eval
    return seen


if __name__ == "__main__":
    print(bare_step(sys.argv[1]))
    print("\n".join(engine_steps(sys.argv[1])))
