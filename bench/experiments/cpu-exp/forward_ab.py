"""In process on the CPU: a model's prompt and decode forwards with the engine's CPU
attention and SiLU (engine/attention.py, engine/cpu_math.py) and with what the engine ran
before them (the model module's names rebound between rounds), alternating. Prints the
medians of each shape's times, ms, and their ratio.

    python bench/experiments/cpu-exp/forward_ab.py MODEL_DIR [--rounds 3]

A Llama-family model (it rebinds mlx_lm.models.llama's names). A prompt forward is one
sequence's first chunk of 512 tokens, or of 2,048; a decode forward is one step of B rows
over T cached tokens (the same step repeated over the same cache).
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models import activations, base, llama
from mlx_lm.models.cache import make_prompt_cache

from engine import attention, mlx_lm_internals

PROMPTS = (512, 2048)
DECODES = ((1, 600), (1, 2000), (8, 1040), (32, 300))  # (rows, cached tokens)


def before(queries, keys, values, cache, scale, mask, sinks=None):
    """The engine's attention before engine.cpu_math: folded (with MLX's softmax) for a
    masked one-token query, MLX's fallback for everything else."""
    if isinstance(mask, mx.array) and queries.shape[2] == 1 and sinks is None:
        return attention.folded_attention(queries, keys, values, scale, mask)
    return base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)


KERNELS = {"cpu": (attention.scaled_dot_product_attention, mlx_lm_internals.swiglu),
           "before": (before, activations.swiglu)}


def prompt_ms(model, length: int) -> float:
    start = time.perf_counter()
    mx.eval(model(mx.array([[5] * length]), cache=make_prompt_cache(model)))
    return (time.perf_counter() - start) * 1e3


def decode_ms(model, rows: int, cached: int, steps: int = 5) -> float:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5] * cached] * rows), cache=cache), [c.state for c in cache])
    fed = mx.array([[6]] * rows)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        mx.eval(model(fed, cache=cache))
        times.append(time.perf_counter() - start)
        for layer in cache:
            layer.offset -= 1
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, _ = load(args.model)
    times: dict[str, dict[str, list[float]]] = {name: {} for name in KERNELS}
    for _ in range(args.rounds):
        for name, (attend, swiglu) in KERNELS.items():
            llama.scaled_dot_product_attention, llama.swiglu = attend, swiglu
            for length in PROMPTS:
                times[name].setdefault(f"prompt {length}", []).append(prompt_ms(model, length))
            for rows, cached in DECODES:
                times[name].setdefault(f"decode {rows}x{cached}", []).append(
                    decode_ms(model, rows, cached))
    medians = {name: {shape: round(statistics.median(v), 1) for shape, v in shapes.items()}
               for name, shapes in times.items()}
    ratios = {shape: round(medians["cpu"][shape] / medians["before"][shape], 2)
              for shape in medians["cpu"]}
    print(json.dumps({"model": args.model, "rounds": args.rounds, "ms": medians,
                      "cpu / before": ratios}, indent=1))


if __name__ == "__main__":
    main()
