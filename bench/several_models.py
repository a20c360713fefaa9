"""Several models in one server: what switching, unloading and a flood cost.

Every model here is a copy of the benchmarked model under another id (a models file), so
a difference from a one-model server is the registry's, not another model's speed.

- `model_switching`: two models, both pinned (loaded), asked in turn, one request at a
  time; against a one-model server asked the same, its engine in its own process as each
  of several models' is (and, reported too, in the server's process). Target: TTFT p50
  within 10%.
- `idle_reload`: a model with its disk tier. A long prompt cold, then an idle unload,
  a reload and the same prompt again. Target: >= 90% cached, TTFT <= 0.2x the cold one
  (the reload's own seconds are reported apart). Reported beside it: the bytes read back
  from disk and their rate, and a third ask, a memory hit, as the floor.
- `model_flood`: three models under a memory budget that fits two, requests spread
  round robin over them, several at once. Target: no errors (a 5xx, or an error event in
  a stream whose status went out before its model loaded), and every greedy answer the
  one-model server's for the same prompt. A second one-model run is the control: on a
  random-weight model, near ties make greedy answers depend on the batch composition.
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
from bench.client import Connection, StreamError, chat
from bench.servers import RADIX, running
from bench.workloads import Shapes, TextSource

GIB = 2**30
# Each model's share in the flood beyond its weights: a step's activations (1.2 GiB at a
# 49k vocabulary and the GPU's 2048-token prefill chunk), the radix cache (1 GiB by
# default) and the running requests' KV of the flood's short prompts.
FLOOD_ROOM_BYTES = 3 * GIB
IDLE_SECONDS = 2.0
WAIT_SECONDS = 600.0


def write_models(path: Path, tables: list[dict]) -> Path:
    """A models file: flat tables, whose JSON values are TOML's too."""
    path.write_text("".join("[[models]]\n" + "".join(f"{key} = {json.dumps(value)}\n"
                                                     for key, value in table.items())
                            for table in tables))
    return path


async def ask(base_url: str, model: str | None, messages: list[dict], max_tokens: int
              ) -> dict:
    """One streamed greedy chat: its TTFT, text and usage, or the HTTP status it failed with."""
    extra = {**RADIX.extra, **({"model": model} if model else {})}
    async with Connection(base_url) as connection:
        try:
            ttft, _, usage, text = await chat(connection, messages, max_tokens, extra)
        except StreamError as error:
            return {"error": str(error)}
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft": ttft, "text": text, "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": details.get("cached_tokens", 0)}


def model_switching(model: Path, shapes: Shapes, env: dict[str, str], logs: Path,
                    seed: int) -> dict:
    source = TextSource(model, seed + 4000)
    prompts = [[{"role": "user", "content": source.text(shapes.ms_prompt_tokens)}]
               for _ in range(shapes.ms_requests)]
    tables = [{"id": name, "source": str(model), "pinned": True} for name in ("a", "b")]
    result = {}
    with tempfile.TemporaryDirectory(prefix="radix-mlx-bench-") as tmp:
        models_file = write_models(Path(tmp) / "models.toml", tables)
        setups = {"one model": (model, [], [None]),
                  "one model, own process": (model, ["--engine-process", "true"], [None]),
                  "two models": (None, ["--models-file", str(models_file)], ["a", "b"])}
        for label, (served, flags, names) in setups.items():
            print(f"  several models: model_switching, {label} ...", file=sys.stderr,
                  flush=True)
            log = logs / f"model_switching-{label.replace(' ', '-').replace(',', '')}.log"
            with running(RADIX, served, env, log, flags) as server:
                for name in names:  # compiled kernels and a first step, for each engine
                    asyncio.run(ask(server.base_url, name, prompts[0], 1))
                answers = [asyncio.run(ask(server.base_url, names[i % len(names)], prompt,
                                           shapes.ms_output_tokens))
                           for i, prompt in enumerate(prompts)]
            result[label] = {"requests": len(answers),
                             "ttft_p50": report.percentile([a["ttft"] for a in answers], 50)}
    # Each of several models runs in an engine process of its own: against one model in
    # its own process, the ratio is what switching costs; against one in the server's
    # process it also holds the hop between the two processes.
    two = result["two models"]["ttft_p50"]
    result["ttft_ratio"] = report.ratio(two, result["one model, own process"]["ttft_p50"])
    result["ttft_ratio_in_process"] = report.ratio(two, result["one model"]["ttft_p50"])
    return result


def idle_reload(model: Path, shapes: Shapes, env: dict[str, str], logs: Path,
                seed: int) -> dict:
    source = TextSource(model, seed + 5000)
    messages = [{"role": "system", "content": source.text(shapes.wr_document_tokens)},
                {"role": "user", "content": source.text(30)}]
    print("  several models: idle_reload ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="radix-mlx-bench-") as tmp:
        models_file = write_models(Path(tmp) / "models.toml", [
            {"id": "m", "source": str(model), "idle_timeout": IDLE_SECONDS},
            {"id": "other", "source": str(model), "pinned": True}])
        flags = ["--models-file", str(models_file), "--disk-cache-dir", str(Path(tmp) / "kv"),
                 "--disk-cache-bytes", str(16 * GIB)]
        with running(RADIX, None, env, logs / "idle_reload.log", flags) as server:
            url = server.base_url
            load_seconds(url, "m")
            cold = asyncio.run(ask(url, "m", messages, shapes.wr_output_tokens))
            wait_for_state(url, "m", "unloaded")
            reload_seconds = load_seconds(url, "m")
            warm = asyncio.run(ask(url, "m", messages, shapes.wr_output_tokens))
            disk = httpx.get(f"{url}/admin/cache", params={"model": "m"},
                             timeout=10).json()["disk"]
            # The floor: the same prompt once more, all of it in memory now.
            memory_hit = asyncio.run(ask(url, "m", messages, shapes.wr_output_tokens))
    return {"prompt_tokens": cold["prompt_tokens"], "ttft_cold": cold["ttft"],
            "reload_seconds": reload_seconds, "ttft_after_reload": warm["ttft"],
            "ttft_memory_hit": memory_hit["ttft"], "disk_load_bytes": disk["load_bytes"],
            "disk_load_bytes_per_second": disk["load_bytes_per_second"],
            "ttft_ratio": report.ratio(warm["ttft"], cold["ttft"]),
            "cached_fraction": warm["cached_tokens"] / max(1, warm["prompt_tokens"]),
            "same_output": warm["text"] == cold["text"]}


def model_flood(model: Path, shapes: Shapes, env: dict[str, str], logs: Path,
                seed: int) -> dict:
    source = TextSource(model, seed + 6000)
    prompts = [[{"role": "user", "content": source.text(shapes.mf_prompt_tokens)}]
               for _ in range(shapes.mf_requests)]
    names = ["m0", "m1", "m2"]
    share = sum(f.stat().st_size for f in model.glob("*.safetensors")) + FLOOD_ROOM_BYTES
    tables = [{"id": name, "source": str(model), "memory_bytes": share} for name in names]
    result: dict = {"models": len(names), "budget_fits": 2,
                    "concurrency": shapes.mf_concurrency}
    answers: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="radix-mlx-bench-") as tmp:
        models_file = write_models(Path(tmp) / "models.toml", tables)
        budget = str(int(2.5 * share))
        # A second one-model run is the control: how many greedy answers survive another
        # batch composition alone (a random-weight model's near ties flip with it).
        setups = {"one model": (model, [], [None]),
                  "one model again": (model, [], [None]),
                  "three models": (None, ["--models-file", str(models_file),
                                          "--memory-limit-bytes", budget], names)}
        for label, (served, flags, served_names) in setups.items():
            print(f"  several models: model_flood, {label} ...", file=sys.stderr, flush=True)
            log = logs / f"model_flood-{label.replace(' ', '-')}.log"
            with running(RADIX, served, env, log, flags) as server:
                started = time.perf_counter()
                answers[label] = asyncio.run(flood(server.base_url, served_names, prompts,
                                                   shapes))
                wall = time.perf_counter() - started
                metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
            result[label] = {"requests": len(prompts), "wall_s": wall,
                             "errors": sum("error" in a for a in answers[label]),
                             "errors_5xx": sum("HTTP 5" in a.get("error", "")
                                               for a in answers[label])}
            if served is None:
                result[label]["unloads"] = series_total(metrics, "radix_mlx_model_unloads_total")
    result["identical_answers"] = identical(answers["one model"], answers["three models"])
    result["identical_answers_control"] = identical(answers["one model"],
                                                    answers["one model again"])
    return result


def identical(ours: list[dict], theirs: list[dict]) -> int:
    return sum(a.get("text") is not None and a.get("text") == b.get("text")
               for a, b in zip(ours, theirs, strict=True))


async def flood(base_url: str, names: list[str | None], prompts: list[list[dict]],
                shapes: Shapes) -> list[dict]:
    gate = asyncio.Semaphore(shapes.mf_concurrency)

    async def one(index: int, messages: list[dict]) -> dict:
        async with gate:
            return await ask(base_url, names[index % len(names)], messages,
                             shapes.mf_output_tokens)

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def load_seconds(base_url: str, name: str) -> float:
    started = time.perf_counter()
    httpx.post(f"{base_url}/admin/models/{name}/load", timeout=WAIT_SECONDS).raise_for_status()
    return time.perf_counter() - started


def wait_for_state(base_url: str, name: str, state: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        cards = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]
        if any(card["id"] == name and card["state"] == state for card in cards):
            return
        time.sleep(0.2)
    raise TimeoutError(f"model {name} not {state} after {WAIT_SECONDS:.0f} s")


def series_total(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{"))


# Each workload's measure, called as (model, shapes, env, logs, seed), in the order they run.
MEASURES = {"model_switching": model_switching, "idle_reload": idle_reload,
            "model_flood": model_flood}
WORKLOADS = tuple(MEASURES)
