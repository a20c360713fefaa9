"""One stream's greedy decode, built every step (as mlx_lm's generate_step) against one
`mx.compile`d step over a fixed-length KV buffer whose offset is an array.

    python bench/experiments/compiled-decode/decode.py MODEL_DIR [--prompt-tokens 64]
        [--max-tokens 256] [--repeats 5] [--out FILE.json]

A built step runs the model's Python (the graph of ~300 operations on a 16-layer model)
every token; a compiled one replays its trace, and fuses elementwise chains into fewer
kernels. A trace holds for one set of input shapes, which a growing KV cache changes at
every token. Two traceable forms: `compiled`, each layer's KV in a buffer of `capacity`
positions, the new token's written at `offset` (an array, so the trace does not depend on
it) and attention masked to the positions written; `shapeless`, one `shapeless=True`
trace attending the KV written so far and the new token's, concatenated (`ViewKV`).
Every loop queues the next step before reading a token, as mlx_lm's `generate_step`
does. Prints medians of alternating runs: tokens/s after the first, the thread's CPU per
token, and how many greedy tokens each agrees with the built loop on (bf16 rounds
differently over a masked buffer, so random weights may part).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


class BufferKV:
    """One layer's KV in a buffer of fixed length; `offset` (an int32 array) is where the
    next token's goes. Quacks as mlx_lm's KVCache where the model reads it."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array) -> None:
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size=None) -> mx.array:
        return mx.arange(self.keys.shape[2]) <= self.offset


class ViewKV:
    """One layer's KV written so far (a view of mlx_lm's buffer) and the new token's,
    attended to concatenated: no mask, so MLX's fused decode attention, and no shape in
    the graph, so one `shapeless` trace serves every length. The caller writes the new
    KV (`new`) into the buffer after the step."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self.new: tuple[mx.array, mx.array] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.new = (keys, values)
        return (mx.concatenate([self.keys, keys], axis=2),
                mx.concatenate([self.values, values], axis=2))


def prefilled(model, prompt: list[int]) -> tuple[list, mx.array]:
    """mlx_lm's cache after `prompt`, and the first token (queued)."""
    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array(prompt)[None], cache=cache)[:, -1], axis=-1)
    mx.async_eval(y)
    return cache, y


def timed(y: mx.array, advance: Callable[[mx.array], mx.array],
          max_tokens: int) -> tuple[list[int], list[float]]:
    """`max_tokens` tokens from `y` on, each step queued before the last token is read."""
    tokens, times = [], []
    for _ in range(max_tokens):
        next_y = advance(y)
        mx.async_eval(next_y)
        tokens.append(y.item())
        times.append(time.perf_counter())
        y = next_y
    return tokens, times


def built_decode(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    cache, y = prefilled(model, prompt)
    return timed(y, lambda y: mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1),
                 max_tokens)


def compiled_decode(model, step, prompt: list[int], max_tokens: int,
                    capacity: int) -> tuple[list[int], list[float]]:
    cache, y = prefilled(model, prompt)
    keys, values = [], []
    for layer in cache:
        pad = [(0, 0), (0, 0), (0, capacity - layer.offset), (0, 0)]
        keys.append(mx.pad(layer.keys[..., :layer.offset, :], pad))
        values.append(mx.pad(layer.values[..., :layer.offset, :], pad))
    state = {"keys": keys, "values": values, "offset": mx.array(len(prompt), mx.int32)}
    mx.eval(y, state)

    def advance(y: mx.array) -> mx.array:
        next_y, state["keys"], state["values"], state["offset"] = step(
            y, state["offset"], state["keys"], state["values"])
        return next_y

    return timed(y, advance, max_tokens)


def shapeless_decode(model, step, prompt: list[int],
                     max_tokens: int) -> tuple[list[int], list[float]]:
    cache, y = prefilled(model, prompt)

    def advance(y: mx.array) -> mx.array:
        at = cache[0].offset
        if at + 1 > cache[0].keys.shape[2]:
            for layer in cache:  # mlx_lm's growth, by its step
                pad = [(0, 0), (0, 0), (0, layer.step), (0, 0)]
                layer.keys, layer.values = mx.pad(layer.keys, pad), mx.pad(layer.values, pad)
        next_y, keys, values = step(
            y, mx.array(at, mx.int32), [layer.keys[..., :at, :] for layer in cache],
            [layer.values[..., :at, :] for layer in cache])
        for layer, k, v in zip(cache, keys, values):
            layer.keys[..., at:at + 1, :] = k
            layer.values[..., at:at + 1, :] = v
            layer.offset += 1
        return next_y

    return timed(y, advance, max_tokens)


def make_shapeless_step(model):
    def step(y, offset, keys, values):
        cache = [ViewKV(k, v, offset) for k, v in zip(keys, values)]
        logits = model(y[:, None], cache=cache)  # (1, 1, vocab): no slice, which has no shapeless form
        return (mx.argmax(logits, axis=-1).squeeze(1), [c.new[0] for c in cache],
                [c.new[1] for c in cache])
    return mx.compile(step, shapeless=True)


def make_step(model):
    def step(y, offset, keys, values):
        cache = [BufferKV(k, v, offset) for k, v in zip(keys, values)]
        logits = model(y[:, None], cache=cache)[:, -1]
        return (mx.argmax(logits, axis=-1), [c.keys for c in cache],
                [c.values for c in cache], offset + 1)
    return mx.compile(step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model, _ = load(str(args.model))
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(args.prompt_tokens)]
    capacity = -(-(args.prompt_tokens + args.max_tokens + 1) // 256) * 256
    step = make_step(model)
    shapeless = make_shapeless_step(model)
    paths = {"built": lambda: built_decode(model, prompt, args.max_tokens),
             "compiled": lambda: compiled_decode(model, step, prompt, args.max_tokens,
                                                 capacity),
             "shapeless": lambda: shapeless_decode(model, shapeless, prompt, args.max_tokens)}
    outputs, failed = {}, {}
    for name, run in list(paths.items()):  # warm-up, and the trace
        try:
            outputs[name] = run()[0]
        except (ValueError, RuntimeError) as error:  # a primitive with no shapeless form
            failed[name] = str(error)
            del paths[name]
    agree = {name: next((i for i, (a, b) in enumerate(zip(outputs["built"], tokens))
                         if a != b), args.max_tokens)
             for name, tokens in outputs.items() if name != "built"}
    rates = {name: [] for name in paths}
    cpu = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, run in paths.items():
            before = time.thread_time()
            _, times = run()
            cpu[name].append(1e6 * (time.thread_time() - before) / args.max_tokens)
            rates[name].append((len(times) - 1) / (times[-1] - times[0]))
    result = {
        "device": str(mx.default_device()),
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "capacity": capacity,
        "tok_s": {name: statistics.median(values) for name, values in rates.items()},
        "cpu_us_per_token": {name: statistics.median(v) for name, v in cpu.items()},
        "greedy_tokens_agreed": agree,
        "runs": rates,
        "failed": failed,
    }
    result["over_built"] = {name: rate / result["tok_s"]["built"]
                            for name, rate in result["tok_s"].items()}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
