"""The disk tier's workloads: the same radix-mlx server with and without it.

- `warm_restart`: one long document and a question, the first request of a fresh server
  (cold), then the same request as the first after a restart (SIGTERM, start again on
  the same cache directory). Memory-only, the restart is cold again; with the disk tier
  the prompt is read back from disk. Target: restart TTFT <= 0.2x cold.
- `agent_working_set`: agents, each with its own long system prompt, taking turns round
  robin (each turn resends its whole history), with the memory budget a third of the
  agents' KV: by the time an agent comes back, least-recently-used eviction has pushed its
  context out of memory. Memory-only, every turn is a full prefill; with the disk tier it
  is a load. Target: >= 2x output tokens/s.

Also reported: bytes/s read back from disk (the server's own load counters).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import report
from bench.client import Connection, chat
from bench.servers import RADIX, running
from bench.workloads import Shapes, TextSource

DISK_BUDGET_BYTES = 16 * 2**30
WAIT_SECONDS = 600.0
# Chat-template tokens around each message, for sizing the working set.
TEMPLATE_TOKENS_PER_MESSAGE = 8


def kv_bytes_per_token(model: Path) -> int:
    """Keys and values of one token over all layers, from the model's config."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    width = {"float32": 4}.get(config.get("torch_dtype", "float32"), 2)
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * width


def cache_report(base_url: str) -> dict:
    return httpx.get(f"{base_url}/admin/cache", timeout=10).json()


def wait_until(base_url: str, ready, what: str) -> dict:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        state = cache_report(base_url)
        if ready(state["disk"]):
            return state
        time.sleep(0.1)
    raise TimeoutError(f"{what} not done after {WAIT_SECONDS:.0f} s")


def writes_done(base_url: str) -> dict:
    return wait_until(base_url, lambda d: not d.get("queued_bytes"), "disk writes")


def rebuilt(base_url: str) -> dict:
    return wait_until(base_url, lambda d: not d.get("rebuilding"), "the rebuild")


async def ask(base_url: str, messages: list[dict], max_tokens: int) -> dict:
    async with Connection(base_url) as connection:
        ttft, latency, usage, text = await chat(connection, messages, max_tokens, RADIX.extra)
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft": ttft, "latency": latency, "text": text,
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": details.get("cached_tokens", 0)}


def load_rate(disk: dict) -> float | None:
    return disk.get("load_bytes_per_second")


def tiers(cache_dir: Path) -> dict[str, list[str]]:
    return {"memory only": ["--disk-cache-bytes", "0"],
            "disk tier": ["--disk-cache-dir", str(cache_dir),
                          "--disk-cache-bytes", str(DISK_BUDGET_BYTES)]}


def warm_restart(model: Path, shapes: Shapes, env: dict[str, str], logs: Path,
                 seed: int) -> dict:
    source = TextSource(model, seed + 2000)
    messages = [{"role": "system", "content": source.text(shapes.wr_document_tokens)},
                {"role": "user", "content": source.text(30)}]
    result = {}
    with tempfile.TemporaryDirectory(prefix="radix-mlx-bench-") as tmp:
        for label, flags in tiers(Path(tmp)).items():
            print(f"  disk tier: warm_restart, {label} ...", file=sys.stderr, flush=True)
            name = label.replace(" ", "-")
            with running(RADIX, model, env, logs / f"warm_restart-{name}-1.log", flags) as s:
                cold = asyncio.run(ask(s.base_url, messages, shapes.wr_output_tokens))
                if "--disk-cache-dir" in flags:
                    writes_done(s.base_url)
            with running(RADIX, model, env, logs / f"warm_restart-{name}-2.log", flags) as s:
                if "--disk-cache-dir" in flags:
                    rebuilt(s.base_url)
                warm = asyncio.run(ask(s.base_url, messages, shapes.wr_output_tokens))
                disk = cache_report(s.base_url)["disk"]
            result[label] = {
                "prompt_tokens": cold["prompt_tokens"], "ttft_cold": cold["ttft"],
                "ttft_after_restart": warm["ttft"],
                "ttft_ratio": report.ratio(warm["ttft"], cold["ttft"]),
                "cached_after_restart": warm["cached_tokens"],
                "same_output": warm["text"] == cold["text"],
                "load_bytes": disk.get("load_bytes"), "load_bytes_per_s": load_rate(disk),
            }
            print(f"    {json.dumps(result[label])}", file=sys.stderr, flush=True)
    return result


def agent_working_set(model: Path, shapes: Shapes, env: dict[str, str], logs: Path,
                      seed: int) -> dict:
    source = TextSource(model, seed + 3000)
    agents = [([{"role": "system", "content": source.text(shapes.ws_system_tokens)}],
               [source.text(shapes.ws_user_tokens) for _ in range(shapes.ws_turns)])
              for _ in range(shapes.ws_agents)]
    context = shapes.ws_system_tokens + shapes.ws_turns * (
        shapes.ws_user_tokens + shapes.ws_output_tokens + 2 * TEMPLATE_TOKENS_PER_MESSAGE)
    working_set = shapes.ws_agents * context * kv_bytes_per_token(model)
    memory_budget = working_set // 3
    result: dict = {"working_set_bytes": working_set, "memory_budget_bytes": memory_budget}
    with tempfile.TemporaryDirectory(prefix="radix-mlx-bench-") as tmp:
        for label, flags in tiers(Path(tmp)).items():
            print(f"  disk tier: agent_working_set, {label} ...", file=sys.stderr, flush=True)
            flags = ["--cache-bytes", str(memory_budget), *flags]
            log = logs / f"agent_working_set-{label.replace(' ', '-')}.log"
            with running(RADIX, model, env, log, flags) as server:
                histories = [list(system) for system, _ in agents]
                turns = []
                started = time.perf_counter()
                for turn in range(shapes.ws_turns):
                    for history, (_, users) in zip(histories, agents):
                        history.append({"role": "user", "content": users[turn]})
                        answer = asyncio.run(ask(server.base_url, history,
                                                 shapes.ws_output_tokens))
                        history.append({"role": "assistant", "content": answer["text"]})
                        turns.append(answer)
                wall = time.perf_counter() - started
                disk = cache_report(server.base_url)
            later = turns[shapes.ws_agents:]  # turns after each agent's first
            result[label] = {
                "requests": len(turns), "wall_s": wall,
                "output_tok_s": sum(t["completion_tokens"] for t in turns) / wall,
                "ttft_p50": report.percentile([t["ttft"] for t in turns], 50),
                "ttft_p50_returning": report.percentile([t["ttft"] for t in later], 50),
                "cached_fraction": sum(t["cached_tokens"] for t in later)
                / max(1, sum(t["prompt_tokens"] for t in later)),
                "disk_hits": disk["disk"].get("hits"),
                "load_bytes": disk["disk"].get("load_bytes"),
                "load_bytes_per_s": load_rate(disk["disk"]),
            }
            print(f"    {json.dumps(result[label])}", file=sys.stderr, flush=True)
    memory, tiered = result["memory only"], result["disk tier"]
    result["throughput_ratio"] = report.ratio(tiered["output_tok_s"], memory["output_tok_s"])
    result["ttft_ratio"] = report.ratio(tiered["ttft_p50"], memory["ttft_p50"])
    return result


# Each workload's measure, called as (model, shapes, env, logs, seed), in the order they run.
MEASURES = {"warm_restart": warm_restart, "agent_working_set": agent_working_set}
WORKLOADS = tuple(MEASURES)
