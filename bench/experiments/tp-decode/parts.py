"""Where tensor-parallel decode's time goes: run as every rank of an mlx.launch group.

    python -m server.launch.rank_launcher -n 2 --starting-port P --nccl-port P -- \
        python bench/experiments/tp-decode/parts.py MODEL_DIR [--tokens 128]

Rank 0 prints one JSON line: the latency of one all-sum of a hidden state (alone, read
at once), bare mlx-lm's sharded decode (stream_generate) on the main thread and on a
worker thread (our engine runs its steps on one), and our Engine's decode over the same
group, in the same processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.utils import load_model, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from engine.api import SamplingParams, TokenEvent
from engine.distributed import RankGroup
from engine.engine import Engine, EngineConfig


def rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def all_sum_us(hidden: int, group: mx.distributed.Group, repeats: int = 50) -> float:
    x = mx.ones((1, 1, hidden), mx.bfloat16)
    mx.eval(mx.distributed.all_sum(x, group=group))
    spent = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        spent.append(time.perf_counter() - start)
    return statistics.median(spent) * 1e6


def bare(model, tokenizer, prompt: list[int], tokens: int) -> float:
    return rate([time.perf_counter() for _ in
                 stream_generate(model, tokenizer, prompt, max_tokens=tokens)])


def in_thread(function, *args):
    result = []
    worker = threading.Thread(target=lambda: result.append(function(*args)))
    worker.start()
    worker.join()
    return result[0]


def through_engine(engine: Engine, prompt: list[int], tokens: int) -> float:
    async def read() -> list[float]:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        return [time.perf_counter() async for event in engine.submit(prompt, params)
                if isinstance(event, TokenEvent)]

    return rate(asyncio.run(read()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    group = mx.distributed.init(strict=True)
    leader = group.rank() == 0
    path = Path(args.model)
    model, config = load_model(path, lazy=True, strict=False)
    model.shard(group)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(path)
    prompt = [(7 * i + 11) % tokenizer.vocab_size for i in range(64)]
    out = {"all_sum_us": all_sum_us(config["hidden_size"], group)}
    bare(model, tokenizer, prompt, 8)
    out["bare_main"] = [bare(model, tokenizer, prompt, args.tokens) for _ in range(args.repeats)]
    out["bare_thread"] = [in_thread(bare, model, tokenizer, prompt, args.tokens)
                          for _ in range(args.repeats)]
    del model
    mx.clear_cache()
    engine = Engine(EngineConfig(model=str(path)), RankGroup(group))
    engine.start()
    if engine.wait_ready() != "ready":
        raise SystemExit(f"rank {group.rank()}: the engine did not start: {engine.error}")
    if leader:
        through_engine(engine, prompt, 8)
        out["engine"] = [through_engine(engine, prompt, args.tokens)
                         for _ in range(args.repeats)]
        print(json.dumps(out), flush=True)
        engine.shutdown()
    engine.wait_stopped()


if __name__ == "__main__":
    main()
