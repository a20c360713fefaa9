"""Bare mlx-lm's warm long-context first token: the bound the servers' warm TTFT is held to.

    python -m bench.raw_long_context MODEL_DIR [--seed 0] [--shapes JSON]

The long_context workload asks questions about one document: the first cold, the rest with
the document cached. Its bound is one decode step plus the uncached tokens' prefill. Rated
at the cold prompt's mean rate, that prefill is below what the forward costs: a few dozen
tokens each attend over the whole document, and a forward has a fixed cost of its own
(docs/benchmarks.md, "Warm long context on an H200, in parts"). Here the bound is measured
instead, on the same prompts: the document's KV computed once into an mlx-lm prompt cache,
then for each warm question `stream_generate` over its own tokens with that cache (trimmed
back to the document after each), the first token's time and the decode step after it.
Runs in its own process and prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from bench.workloads import Shapes, build_all, first_turns
from radix.prefix import common_prefix_length

PREFILL_CHUNK = 2048  # mlx-lm's own prefill step size


def prefill(model, cache: list, tokens: list[int]) -> None:
    for start in range(0, len(tokens), PREFILL_CHUNK):
        model(mx.array(tokens[start:start + PREFILL_CHUNK])[None], cache=cache)
        mx.eval([c.state for c in cache])


def first_token_and_step(model, tokenizer, tokens: list[int], cache: list
                         ) -> tuple[float, float]:
    """(seconds to the first token, seconds of the decode step after it) of one question
    over the cached document."""
    start = time.perf_counter()
    times = []
    for _ in stream_generate(model, tokenizer, tokens, prompt_cache=cache, max_tokens=2):
        times.append(time.perf_counter())
    return times[0] - start, times[1] - times[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shapes", default="{}", help="Shapes fields that differ, as JSON")
    args = parser.parse_args()
    workload = next(w for w in build_all(args.model, Shapes(**json.loads(args.shapes)),
                                         args.seed) if w.name == "long_context")
    model, tokenizer = load(str(args.model))
    prompts = first_turns(tokenizer, workload, chat=True)
    cold, warm = prompts[0], prompts[1:]
    # The document: what every question shares with the first, less a token so that each
    # question forwards at least one of its own.
    document = min(min(common_prefix_length(cold, p), len(p) - 1) for p in warm)
    cache = make_prompt_cache(model)
    if not can_trim_prompt_cache(cache):
        raise SystemExit("bench.raw_long_context: this model's cache cannot be trimmed back")
    prefill(model, cache, cold[:document])
    first_token_and_step(model, tokenizer, cold[document:], cache)  # compile, untimed
    firsts, steps = [], []
    for prompt in warm:
        trim_prompt_cache(cache, cache[0].offset - document)
        first, step = first_token_and_step(model, tokenizer, prompt[document:], cache)
        firsts.append(first)
        steps.append(step)
    first, step = statistics.median(firsts), statistics.median(steps)
    print(json.dumps({
        "document_tokens": document,
        "uncached_tokens": statistics.mean(len(p) - document for p in warm),
        "questions": len(warm),
        "first_token_s": first,
        "decode_step_s": step,
        "bound_s": first + step,
        "first_token_s_each": firsts,
        "device": str(mx.default_device()),
    }))


if __name__ == "__main__":
    main()
