"""Bare mlx-lm batching baselines for the batch workloads: `BatchGenerator` (through
`mlx_lm.batch_generate`) on the same prompts the servers get.

    python -m bench.raw_batch MODEL_DIR {batch_decode,classify} [--seed 0] [--shapes JSON]

batch_decode: all the workload's prompts in one batch (completion batch size = streams),
output tok/s over the whole call, prefill included, as the servers' rate is measured.
classify: the prompts in lists of `cl_batch`, one `batch_generate(..., max_tokens=1)`
call per list, one after another as the client sends them; sentences/s.
Runs in its own process and prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import batch_generate, load

from bench.workloads import Shapes, build_all, first_turns


def timed(model, tokenizer, batches: list[list[list[int]]], max_tokens: int,
          batch_size: int) -> tuple[float, int]:
    """(seconds, generated tokens) for one batch_generate call per batch, in turn."""
    start = time.perf_counter()
    tokens = 0
    for prompts in batches:
        response = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens,
                                  completion_batch_size=batch_size,
                                  prefill_batch_size=batch_size, return_token_ids=True)
        tokens += sum(len(ids) for ids in response.token_ids)
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("workload", choices=("batch_decode", "classify"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shapes", default="{}", help="Shapes fields that differ, as JSON")
    args = parser.parse_args()
    shapes = Shapes(**json.loads(args.shapes))
    workload = next(w for w in build_all(args.model, shapes, args.seed)
                    if w.name == args.workload)
    model, tokenizer = load(str(args.model))
    prompts = first_turns(tokenizer, workload, chat=not workload.batch)
    size = workload.batch or len(prompts)
    batches = [prompts[i:i + size] for i in range(0, len(prompts), size)]
    timed(model, tokenizer, batches[:1], 2, size)  # compile kernels before timing
    seconds, tokens = timed(model, tokenizer, batches, workload.max_tokens, size)
    print(json.dumps({
        "workload": workload.name,
        "prompts": len(prompts),
        "batch": size,
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tok_s": tokens / seconds,
        "prompts_s": len(prompts) / seconds,
        "device": str(mx.default_device()),
        "peak_memory_bytes": mx.get_peak_memory(),
    }))


if __name__ == "__main__":
    main()
