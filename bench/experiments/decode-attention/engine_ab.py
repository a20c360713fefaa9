"""In process on the CPU: the engine decoding a few streams behind long prompts, with the
folded attention and with mlx-lm's own (the model module's name rebound between runs),
alternating. Prints each setting's ITL p50 per round.

    python bench/experiments/decode-attention/engine_ab.py MODEL_DIR

A Llama-family model (it rebinds mlx_lm.models.llama's name). Streams of random prompts
(cold each time), 48 tokens each, greedy; the ITL from the ninth token on.
"""

import asyncio
import itertools
import json
import random
import statistics
import sys
import time

from mlx_lm.models import base, llama

from engine import attention
from engine.api import SamplingParams
from engine.engine import Engine, EngineConfig

SHAPES = [(4, 1500), (8, 1100), (1, 1500)]  # (streams, prompt tokens); 1 row has no mask
ATTENTION = {"folded": attention.scaled_dot_product_attention,
             "mlx-lm": base.scaled_dot_product_attention}


async def itl_ms(engine: Engine, rows: int, length: int, rng: random.Random) -> float:
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    async def times(prompt: list[int]) -> list[float]:
        return [time.perf_counter() async for _ in engine.submit(prompt, params)]

    prompts = [[rng.randrange(10, 3000) for _ in range(length)] for _ in range(rows)]
    runs = await asyncio.gather(*map(times, prompts))
    return statistics.median(b - a for t in runs for a, b in itertools.pairwise(t[8:])) * 1e3


def main() -> None:
    engine = Engine(EngineConfig(model=sys.argv[1], max_batch_size=16))
    engine.start()
    engine.wait_ready()
    rng = random.Random(0)
    for rows, length in SHAPES:
        itl: dict[str, list[float]] = {name: [] for name in ATTENTION}
        for _ in range(3):
            for name, function in ATTENTION.items():
                llama.scaled_dot_product_attention = function
                itl[name].append(round(asyncio.run(itl_ms(engine, rows, length, rng)), 1))
        print(json.dumps({"streams": rows, "prompt_tokens": length, "itl_p50_ms": itl}),
              flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
