"""`--kv-bits`: the same radix-mlx server with its prefix cache in the model's dtype, at 8
bits and at 4 (the `kv_quant` workload).

Each server, a fresh start, runs:

- `shared_prefix` (the workload of that name): output tok/s against the unquantized
  server's (target >= 0.95x at 8 bits), then its tree's tokens and bytes (/metrics):
  cached tokens per GiB, against the unquantized server's and against bfloat16 KV of the
  same shape (target >= 1.9x at 8 bits);
- greedy identity: 32 chats behind one system prompt, which each finds cached; their
  answers against the unquantized server's (target: >= 30 of 32 equal at 8 bits); then,
  on a quantized server, each again with the cache emptied first: how often a hit
  answers as the same server's cold prompt does.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx

from bench import report
from bench.client import run_workload
from bench.disk_tier import ask
from bench.servers import RADIX, running
from bench.workloads import Shapes, TextSource, build_all, build_warm_up

WORKLOADS = ("kv_quant",)
KV_BITS = (None, 8, 4)
IDENTITY_PROMPTS = 32
IDENTITY_SYSTEM_TOKENS = 200
IDENTITY_QUESTION_TOKENS = 20
IDENTITY_OUTPUT_TOKENS = 32
GROUP_SIZE = 64  # --kv-group-size's default


def label(bits: int | None) -> str:
    return f"kv_bits {bits}" if bits else "model dtype"


def shape(model: Path) -> tuple[int, int, int]:
    """Layers, KV heads and head dimension, from the model's config."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"], config["num_key_value_heads"], head_dim


def bf16_bytes_per_token(model: Path) -> int:
    """Keys and values of one token over all layers in bfloat16."""
    layers, heads, head_dim = shape(model)
    return 2 * layers * heads * head_dim * 2


def metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("radix_mlx_tree_"):
            values[name.split("{")[0]] = float(value)
    return values


def identity_chats(model: Path, seed: int) -> list[list[dict]]:
    source = TextSource(model, seed + 4000)
    system = {"role": "system", "content": source.text(IDENTITY_SYSTEM_TOKENS)}
    return [[system, {"role": "user", "content": source.text(IDENTITY_QUESTION_TOKENS)}]
            for _ in range(IDENTITY_PROMPTS)]


async def answers(base_url: str, chats: list[list[dict]], cold: bool) -> list[dict]:
    """Each chat's greedy answer in turn; `cold`: with the cache emptied before each."""
    found = []
    for messages in chats:
        if cold:
            async with httpx.AsyncClient(timeout=60) as client:
                (await client.delete(f"{base_url}/admin/cache")).raise_for_status()
        found.append(await ask(base_url, messages, IDENTITY_OUTPUT_TOKENS))
    return found


def run(model: Path, shapes: Shapes, env: dict[str, str], out: Path, seed: int) -> dict:
    head_dim = shape(model)[2]
    if head_dim % GROUP_SIZE:
        return {"skipped": f"head dimension {head_dim}: the default group size "
                           f"{GROUP_SIZE} does not divide it, and --kv-bits refuses the model"}
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    workload = next(w for w in build_all(model, shapes, seed) if w.name == "shared_prefix")
    warm_up = build_warm_up(model, shapes, seed)
    chats = identity_chats(model, seed)
    result: dict = {"bf16_bytes_per_token": bf16_bytes_per_token(model),
                    "prompts": IDENTITY_PROMPTS}
    for bits in KV_BITS:
        name = label(bits)
        print(f"  kv_quant: {name} ...", file=sys.stderr, flush=True)
        flags = ["--kv-bits", str(bits)] if bits else []
        with running(RADIX, model, env, logs / f"{name.replace(' ', '-')}.log", flags) as s:
            asyncio.run(run_workload(s.base_url, warm_up, RADIX.extra))
            measured = asyncio.run(run_workload(s.base_url, workload, RADIX.extra))
            summary = report.summarize(measured, s.sampler.take_peak(), None)
            tree = metrics(s.base_url)
            hits = asyncio.run(answers(s.base_url, chats, cold=False))
            colds = asyncio.run(answers(s.base_url, chats, cold=True)) if bits else hits
        tokens, nbytes = tree["radix_mlx_tree_tokens"], tree["radix_mlx_tree_bytes"]
        result[name] = {
            "output_tok_s": summary["output_tok_s"], "ttft_p50": summary["ttft_p50"],
            "cache_fraction": summary["cache_fraction"], "errors": summary["errors"],
            "tree_tokens": tokens, "tree_bytes": nbytes,
            "bytes_per_token": nbytes / tokens if tokens else None,
            "cached_tokens_per_gib": tokens / nbytes * 2**30 if nbytes else None,
            "hits_cached": sum(a["cached_tokens"] > 0 for a in hits),
            "texts": [a["text"] for a in hits],
            "hit_equals_cold": sum(h["text"] == c["text"] for h, c in zip(hits, colds)),
        }
        print(f"    {json.dumps({k: v for k, v in result[name].items() if k != 'texts'})}",
              file=sys.stderr, flush=True)
    base = result[label(None)]
    for bits in KV_BITS[1:]:
        row = result[label(bits)]
        row["throughput_ratio"] = report.ratio(row["output_tok_s"], base["output_tok_s"])
        row["tokens_per_gib_ratio"] = report.ratio(row["cached_tokens_per_gib"],
                                                   base["cached_tokens_per_gib"])
        row["tokens_per_gib_vs_bf16"] = report.ratio(result["bf16_bytes_per_token"],
                                                     row["bytes_per_token"])
        row["identical_to_unquantized"] = sum(
            a == b for a, b in zip(row["texts"], base["texts"]))
    return result
