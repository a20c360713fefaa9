"""`python -m bench` / `make bench`: radix-mlx and mlx-lm's server, side by side.

For each model (by default the random-weight 'bench' shape and the real default model,
SmolLM2-135M-Instruct) and each workload, starts each server in turn on the same model (one at a time: they
would fight over the cores or the GPU), warms it up, runs the seeded workload against it
through a streaming client and stops it. Fresh starts keep one workload's cache out of
the next, and alternating keeps the two measurements of a ratio close in time on a
machine whose load drifts. Then it times bare `mlx_lm.stream_generate` for the engine
overhead figure and constrained vs free decoding on one engine (bench/structured.py), and
writes results.json, results.md and plots to bench/results/<hardware>/<model>/, one folder
per model. The bench process itself never imports MLX. On a model given as a GGUF file,
`--servers ...,llama-cpp` adds llama.cpp's own server, on that file, as a CPU peer; on a
GPU, `--llama-cpp-gguf` gives it the GGUF export of a model directory (bench/gpu.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import httpx
from transformers import AutoTokenizer

from bench import (
    disk_tier,
    hardware,
    kv_quant,
    prefill_endpoints,
    report,
    several_models,
    snapshot_models,
    speculation,
)
from bench.child import child_json
from bench.client import run_workload
from bench.servers import (
    LLAMA_CPP,
    RADIX,
    REPLICA_POLICIES,
    SPECS,
    RunningServer,
    ServerSpec,
    llama_cpp,
    replicas,
    running,
    scrape_active_memory,
    tensor_parallel,
)
from bench.workloads import (
    QUICK,
    RAW_BATCH_WORKLOADS,
    RAW_ROUND_MODULES,
    WORKLOADS,
    Shapes,
    Workload,
    build_all,
    build_list_warm_up,
    build_warm_up,
    first_turns,
    optimal_cached_tokens,
)
from engine.platform_info import cpu_reexec_env, mlx_would_use_cpu

RESULTS = Path(__file__).parent / "results"
# What replicas behind a router are measured on: prefix reuse across requests.
REPLICA_WORKLOADS = ("shared_prefix", "multi_turn")
# What a tensor-parallel server is measured on: one stream's decode, a cold long prefill.
TP_WORKLOADS = ("single_stream", "long_context", "batch_decode")
METRICS_POLL_SECONDS = 0.5


def all_workloads() -> list[str]:
    return [*WORKLOADS, *disk_tier.WORKLOADS, *several_models.WORKLOADS,
            *kv_quant.WORKLOADS, *snapshot_models.WORKLOADS, *speculation.WORKLOADS,
            *prefill_endpoints.WORKLOADS]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", dest="models", metavar="MODEL",
                        help="model directory or .gguf file, repeatable (default: the 143M "
                             "float32 'bench' demo model, then the real default model, "
                             "SmolLM2-135M-Instruct, as radix-mlx serve converts it; with "
                             "--quick only the real one)")
    parser.add_argument("--servers", default=",".join(SPECS),
                        help=f"comma-separated, from {sorted([*SPECS, LLAMA_CPP])} "
                             f"(default: {','.join(SPECS)}; {LLAMA_CPP}, llama.cpp's "
                             "llama-server, runs only on a GGUF model, as the default is)")
    parser.add_argument("--workloads", default=",".join(all_workloads()),
                        help=f"comma-separated, from {all_workloads()} "
                             f"({', '.join(disk_tier.WORKLOADS)}: radix-mlx with and without "
                             f"its disk tier; {', '.join(several_models.WORKLOADS)}: several "
                             "models in one server against one; "
                             f"{snapshot_models.WORKLOADS[0]}: shared_prefix and "
                             "multi_turn on tiny sliding-window and hybrid models, whatever "
                             f"--model says; {', '.join(speculation.WORKLOADS)}: radix-mlx "
                             "with speculative decoding off, on and auto)")
    parser.add_argument("--quick", action="store_true", help="toy sizes, for a smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="results folder, with one subfolder per "
                        "model when there are several (default: bench/results/<hardware>)")
    for name in (*SPECS, LLAMA_CPP):
        parser.add_argument(f"--{name}-args", default="", metavar="FLAGS",
                            help=f"extra flags for {name}'s server (default: none)")
    parser.add_argument("--draft-model", metavar="DIR",
                        help="agent_edit also runs radix-mlx with --speculation on and this "
                             "draft model as its only draft source (a small model of the "
                             "benchmarked model's tokenizer)")
    parser.add_argument("--llama-server", default=shutil.which("llama-server"), metavar="PATH",
                        help=f"llama.cpp's server binary for {LLAMA_CPP} (default: "
                             "llama-server on PATH)")
    parser.add_argument("--llama-cpp-gguf", type=Path, metavar="FILE",
                        help=f"the GGUF file {LLAMA_CPP} serves when the one --model is a "
                             "directory (`python -m bench.gguf_export` writes one from it)")
    parser.add_argument("--replicas", type=int, default=0, metavar="N",
                        help="also run N radix-mlx workers behind sglang-router, once with "
                             f"each of {', '.join(REPLICA_POLICIES)}, on "
                             f"{' and '.join(REPLICA_WORKLOADS)} (workers get "
                             "--radix-mlx-args too; default: 0, none)")
    parser.add_argument("--replicas-cuda-devices", default="", metavar="LIST",
                        help="give replica i only CUDA device i mod count of this comma-"
                             "separated list, e.g. 0,1 (default: every replica sees all)")
    parser.add_argument("--tensor-parallel", type=int, default=0, metavar="N",
                        help="also run radix-mlx with its model sharded over N ranks "
                             f"(--tensor-parallel N) on {', '.join(TP_WORKLOADS)}: decode, "
                             "prefill and batch tok/s against one server and single-stream "
                             "decode against bare mlx-lm sharded N ways (it gets "
                             "--radix-mlx-args too; default: 0, none)")
    parser.add_argument("--restart-per-workload", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="a fresh start of each server per workload, servers alternating, "
                             "so caches start empty and each ratio is measured minutes apart "
                             "at most (default); --no-restart-per-workload: one start each")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="measure every workload N times on each server, servers "
                             "alternating, and the bare mlx-lm batch baselines once in each "
                             "round, every other round in mirror order (bare first, servers "
                             "reversed): the tables and targets are medians over rounds, "
                             "results.json keeps each round's numbers (default: 1)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's temperature (default 0: greedy, so that the "
                             "servers generate alike); above 0, sampled traffic as chat "
                             "clients send it by default")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib)")
    parser.add_argument("--no-raw", action="store_true",
                        help="skip the bare mlx-lm baselines (stream_generate and batch_generate)")
    parser.add_argument("--no-structured", action="store_true",
                        help="skip constrained vs free decoding (bench/structured.py)")
    for field in dataclasses.fields(Shapes):
        parser.add_argument("--" + field.name.replace("_", "-"), type=int,
                            help=f"default {field.default}, --quick {getattr(QUICK, field.name)}")
    args = parser.parse_args(argv)
    unknown = set(args.workloads.split(",")) - set(all_workloads())
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    unknown = set(args.servers.split(",")) - {*SPECS, LLAMA_CPP}
    if unknown:
        parser.error(f"unknown servers: {', '.join(sorted(unknown))}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.llama_cpp_gguf and len(args.models or []) != 1:
        parser.error("--llama-cpp-gguf goes with exactly one --model")
    return args


def shapes_from(args: argparse.Namespace) -> Shapes:
    base = QUICK if args.quick else Shapes()
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Shapes)
             if getattr(args, f.name) is not None}
    return dataclasses.replace(base, **given)


class WarmUps(NamedTuple):
    chats: Workload  # before a server's first workload
    lists: Workload  # before each list workload of a server that takes lists


class BenchModel(NamedTuple):
    directory: Path  # what the MLX servers load
    gguf: Path | None  # the file it was converted from, if any (what llama.cpp loads)


def model_dirs(models: list[str] | None, env: dict[str, str],
               quick: bool = False) -> list[BenchModel]:
    """The models to bench: a .gguf converted (and cached) as `radix-mlx serve`
    converts it; none given: the cached `bench` demo model and the default real model
    (only the latter when quick, to keep a smoke run short). Resolved in a child so this
    process stays MLX-free."""
    code = ("import sys\n"
            "from engine.demo_model import demo_model_path\n"
            "from engine.model_source import default_model_file, is_gguf_source, "
            "resolve_model\n"
            "for model in sys.argv[1:]:\n"
            "    if model == 'bench':\n"
            "        print(demo_model_path('bench'), '', sep='\\t')\n"
            "        continue\n"
            "    source = model or str(default_model_file())\n"
            "    print(resolve_model(source), source if is_gguf_source(source) else '', "
            "sep='\\t')\n")
    default = [""] if quick else ["bench", ""]
    given = [str(Path(m).expanduser().resolve()) for m in models or []] or default
    result = subprocess.run([sys.executable, "-c", code, *given], env=env, check=True,
                            capture_output=True, text=True)
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    return [BenchModel(Path(directory), Path(gguf) if gguf else None)
            for directory, gguf in rows]


def git_revision() -> str | None:
    """HEAD, with '+dirty' when the checkout has changes (the numbers are of that code)."""
    run = [subprocess.run(["git", *cmd], capture_output=True, text=True, check=False,
                          cwd=Path(__file__).parent)
           for cmd in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])]
    if run[0].returncode != 0:
        return None
    return run[0].stdout.strip() + ("+dirty" if run[1].stdout.strip() else "")


def describe_model(model: Path) -> dict:
    config = json.loads((model / "config.json").read_text())
    gguf = config.get("gguf")
    dtype = gguf["dtype"] if gguf else config.get("torch_dtype", "float32")
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    width = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    params = size / width
    weights = f"the weights of {gguf['file']}" if gguf else "random weights"
    size_text = f"{size / 2**20:.0f} MiB" if "quantization" in config else \
        f"~{params / 1e6:.0f}M parameters"
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {
        "name": model.name,
        "path": str(model),
        "weights_bytes": size,
        # K and V of every layer: what one cached token adds to a decode step's reads.
        "kv_bytes_per_token": 2 * config["num_hidden_layers"] * config["num_key_value_heads"]
        * head_dim * width,
        "description": (
            f"{config['model_type']}, hidden {config['hidden_size']}, "
            f"{config['num_hidden_layers']} layers, {config['num_attention_heads']} heads, "
            f"{config['num_key_value_heads']} KV heads, MLP {config['intermediate_size']}, "
            f"vocab {config['vocab_size']}, {dtype}, {size_text}, {weights}"),
    }


async def poll_active_memory(base_url: str, peak: list[int]) -> None:
    """Keep the highest MLX active memory seen in peak[0] until cancelled."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            await sample_active_memory(client, base_url, peak)
            await asyncio.sleep(METRICS_POLL_SECONDS)


async def sample_active_memory(client: httpx.AsyncClient, base_url: str,
                               peak: list[int]) -> None:
    value = await scrape_active_memory(client, base_url)
    if value is not None:
        peak[0] = max(peak[0], value)


async def measure(server: RunningServer, warm_ups: WarmUps, workloads: list[Workload],
                  temperature: float) -> tuple[dict, dict]:
    """(summaries, per-request records) by workload, after an untimed warm-up (and
    before a list workload, untimed lists)."""
    extra = {**server.spec.extra, "temperature": temperature}
    await run_workload(server.base_url, warm_ups.chats, extra)
    summaries, records = {}, {}
    for workload in workloads:
        if workload.batch:
            await run_workload(server.base_url, warm_ups.lists, extra)
        print(f"  {server.spec.name}: {workload.name} ...", file=sys.stderr, flush=True)
        server.sampler.take_peak()
        peak = [0]
        poller = asyncio.create_task(poll_active_memory(server.base_url, peak)) \
            if server.spec.metrics else None
        try:
            run = await run_workload(server.base_url, workload, extra)
        finally:
            if poller is not None:
                poller.cancel()
        if poller is not None:  # a run shorter than a poll gets what it left active
            async with httpx.AsyncClient(timeout=5.0) as client:
                await sample_active_memory(client, server.base_url, peak)
        summaries[workload.name] = report.summarize(
            run, server.sampler.take_peak(), peak[0] if poller is not None else None)
        records[workload.name] = [r.as_dict() for r in run.requests]
        print(f"    {json.dumps({k: v for k, v in summaries[workload.name].items()})}",
              file=sys.stderr, flush=True)
    return summaries, records


def server_args(spec: ServerSpec, args: argparse.Namespace) -> list[str]:
    """The --<server>-args flags; replicas pass radix-mlx's on to every worker, after
    radix-mlx's own fixed flags (the disk tier off: files a worker kept from an earlier
    run would turn a cold workload warm)."""
    if spec.router_workers:
        return ["--", *RADIX.args, *shlex.split(args.radix_mlx_args)]
    if spec.tensor_parallel:
        return shlex.split(args.radix_mlx_args)
    return shlex.split(getattr(args, f"{spec.name.replace('-', '_')}_args"))


def run_measures(measures: dict, wanted: list[str], model: Path, shapes: Shapes,
                 env: dict[str, str], out: Path, seed: int) -> dict:
    """The wanted workloads of a module that starts its own servers (disk_tier,
    speculation, several_models, prefill_endpoints), each by its measure, logs in
    OUT/logs."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return {name: measure(model, shapes, env, logs, seed)
            for name, measure in measures.items() if name in wanted}


def server_env(spec: ServerSpec, env: dict[str, str], args: argparse.Namespace
               ) -> dict[str, str]:
    """With replicas pinned to GPUs, a one-process server sees only the first of them, as
    each replica sees its own: the baseline is then one GPU's server. On 4 H200s, one
    server that saw all four ran multi-turn at 577 tok/s, and 1415 on a machine with one
    (bench/results/nvidia-h200-x4/scale-out-replicas-1b-vocab49152)."""
    if not args.replicas_cuda_devices or spec.router_workers or spec.tensor_parallel:
        return env
    return {**env, "CUDA_VISIBLE_DEVICES": args.replicas_cuda_devices.split(",")[0]}


def run_server(results: dict, spec: ServerSpec, args: argparse.Namespace, model: Path,
               env: dict[str, str], out: Path, warm_ups: WarmUps,
               workloads: list[Workload], round_index: int = 0) -> None:
    """Start one server, measure `workloads` on it, stop it, and add what it measured to
    `results` as round `round_index` (`report.median_summary` makes the tables' numbers)."""
    name = spec.name
    workloads = [w for w in workloads if spec.list_prompts or not w.batch]
    if not workloads:
        return
    label = name if len(workloads) > 1 else f"{name}-{workloads[0].name}"
    if args.rounds > 1:
        label += f"-round{round_index + 1}"
    print(f"bench: starting {label} on {model}", file=sys.stderr, flush=True)
    extra_args = server_args(spec, args)
    with running(spec, model, env, out / "logs" / f"{label}.log", extra_args) as server:
        summaries, records = asyncio.run(measure(server, warm_ups, workloads,
                                                 args.temperature))
        died = server.process.poll()
    entry = results["servers"].setdefault(name, {
        "argv": server.argv, "notes": spec.notes, "workloads": {}, "rounds": {},
        "requests": {}, "exit_code_during_run": None, "router_workers": spec.router_workers,
        "tensor_parallel": spec.tensor_parallel})
    for workload, summary in summaries.items():
        entry["rounds"].setdefault(workload, []).append(summary)
        entry["requests"].setdefault(workload, []).extend(
            {**record, "round": round_index} for record in records[workload])
    if died is not None:
        entry["exit_code_during_run"] = died


def run_bare_rounds(raw_rounds: dict[str, list[dict]], model: Path, env: dict[str, str],
                    shapes: Shapes, seed: int, round_index: int) -> None:
    """One round of each bare mlx-lm baseline, appended to its list in `raw_rounds`. They
    run in every round beside the servers', not all at the end: a GPU host's speed moves
    by up to 1.8x over minutes (its steps are host-bound), so a baseline run after every
    server's rounds measured another host (nvidia-h200/batch-decode-64-1b)."""
    for name, rounds in raw_rounds.items():
        print(f"bench: bare mlx_lm ({name}), round {round_index + 1}",
              file=sys.stderr, flush=True)
        rounds.append(child_json(
            RAW_ROUND_MODULES[name], model, env,
            *([name] if name in RAW_BATCH_WORKLOADS else []),
            "--seed", seed, "--shapes", json.dumps(shapes.as_dict())))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = cpu_reexec_env() or dict(os.environ)
    device = "cpu" if mlx_would_use_cpu() else "gpu"
    wanted = set(args.workloads.split(","))
    models = model_dirs(args.models, env, args.quick) if wanted - set(
        snapshot_models.WORKLOADS) else []
    if args.llama_cpp_gguf:
        models = [model._replace(gguf=model.gguf or args.llama_cpp_gguf) for model in models]
    for model in models:
        out = (args.out or RESULTS / hardware.tag(device)) / model.directory.name
        if args.out and len(models) == 1:
            out = args.out
        bench_model(args, model, device, env, out, argv)
    if wanted & set(snapshot_models.WORKLOADS):
        out = (args.out or RESULTS / hardware.tag(device)) / "snapshot-models"
        results = {"command": shlex.join(["python", "-m", "bench", *(argv or sys.argv[1:])]),
                   "git": git_revision(), "hardware": hardware.describe(device),
                   "shapes": shapes_from(args).as_dict()}
        results["families"] = snapshot_models.run(
            [SPECS[name] for name in args.servers.split(",") if name in SPECS],
            shapes_from(args), env, out, args.seed)
        snapshot_models.write(results, out)
        print((out / "results.md").read_text())


def server_specs(args: argparse.Namespace, model: BenchModel,
                 device: str = "cpu") -> tuple[list[ServerSpec], dict[str, str]]:
    """The servers --servers names for this model, and why any of them cannot run."""
    specs, skipped = [], {}
    for name in args.servers.split(","):
        if name != LLAMA_CPP:
            specs.append(SPECS[name])
        elif model.gguf is None:
            skipped[name] = "it serves a .gguf file, and this model is not one"
        elif not args.llama_server:
            skipped[name] = "no llama-server on PATH (install llama.cpp or pass --llama-server)"
        else:
            specs.append(llama_cpp(args.llama_server, gpu=device == "gpu"))
    return specs, skipped


def optimal_cache_fractions(model_dir: Path, workloads: list[Workload]) -> dict[str, float]:
    """For each workload of single-turn chats, the share of its prompt tokens an ideal
    prefix cache serves (`optimal_cached_tokens`), which its measured share is read
    against. Later turns depend on what the model answered, so chats of several turns
    have none."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fractions = {}
    for workload in workloads:
        if workload.batch or any(len(c.user_turns) > 1 for c in workload.conversations):
            continue
        prompts = first_turns(tokenizer, workload, chat=True)
        fractions[workload.name] = optimal_cached_tokens(prompts) / sum(map(len, prompts))
    return fractions


def bench_model(args: argparse.Namespace, model: BenchModel, device: str,
                env: dict[str, str], out: Path, argv: list[str] | None) -> None:
    shapes = shapes_from(args)
    wanted = args.workloads.split(",")
    workloads = [w for w in build_all(model.directory, shapes, args.seed) if w.name in wanted]
    warm_ups = WarmUps(build_warm_up(model.directory, shapes, args.seed),
                       build_list_warm_up(model.directory, shapes, args.seed))
    specs, skipped = server_specs(args, model, device)
    for name, reason in skipped.items():
        print(f"bench: not running {name}: {reason}", file=sys.stderr, flush=True)
    results: dict = {
        "command": shlex.join(["python", "-m", "bench", *(argv or sys.argv[1:])]),
        "git": git_revision(),
        "hardware": hardware.describe(device),
        "model": describe_model(model.directory),
        "shapes": shapes.as_dict(),
        "seed": args.seed,
        "rounds": args.rounds,
        "workloads": [w.name for w in workloads],
        "servers": {},
        "skipped_servers": skipped,
        "optimal_cache_fraction": optimal_cache_fractions(model.directory, workloads),
    }
    smi = hardware.nvidia_smi()
    if smi:
        out.mkdir(parents=True, exist_ok=True)
        (out / "nvidia-smi.txt").write_text(smi)
    if args.replicas:
        specs += [replicas(policy, args.replicas, args.replicas_cuda_devices)
                  for policy in REPLICA_POLICIES]
    if args.tensor_parallel > 1:
        specs.append(tensor_parallel(args.tensor_parallel))
    batches = [[w] for w in workloads] if args.restart_per_workload else [workloads] * bool(
        workloads)
    raw_rounds: dict[str, list[dict]] = {} if args.no_raw else {
        w.name: [] for w in workloads if w.name in RAW_ROUND_MODULES}
    for round_index in range(args.rounds):
        # Every other round runs in mirror order, bare mlx-lm first and the servers
        # reversed, so that a drift over the run, or whatever one path leaves the host or
        # device in for the next, falls on every path alike: run in one order, our 8B
        # batch decode was the slower in its second round, right after bare's, in six of
        # seven leases (nvidia-h200/llama-cpp-8b-vocab49152).
        mirrored = round_index % 2 == 1
        if mirrored:
            run_bare_rounds(raw_rounds, model.directory, env, shapes, args.seed, round_index)
        for batch in batches:
            for spec in reversed(specs) if mirrored else specs:
                measured = [w for w in batch
                            if (not spec.router_workers or w.name in REPLICA_WORKLOADS)
                            and (not spec.tensor_parallel or w.name in TP_WORKLOADS)]
                if measured:
                    served = model.gguf if spec.serves_gguf else model.directory
                    run_server(results, spec, args, served, server_env(spec, env, args),
                               out, warm_ups, measured, round_index)
        if not mirrored:
            run_bare_rounds(raw_rounds, model.directory, env, shapes, args.seed, round_index)
    for entry in results["servers"].values():
        entry["workloads"] = {workload: report.median_summary(rounds)
                              for workload, rounds in entry["rounds"].items()}
    for key, module, what in (("disk_tier", disk_tier, "with and without its disk tier"),
                              ("speculation", speculation, "speculative decoding off, on and auto"),
                              ("several_models", several_models, "several models in one server"),
                              ("prefill_endpoints", prefill_endpoints,
                               "embeddings and rerank")):
        if set(wanted) & set(module.WORKLOADS):
            print(f"bench: radix-mlx {what}", file=sys.stderr, flush=True)
            measures = (speculation.measures(args.draft_model) if module is speculation
                        else module.MEASURES)
            results[key] = run_measures(measures, wanted, model.directory, shapes, env,
                                        out, args.seed)
    if set(wanted) & set(kv_quant.WORKLOADS):
        print("bench: radix-mlx at --kv-bits 8 and 4 against unquantized", file=sys.stderr,
              flush=True)
        results["kv_quant"] = kv_quant.run(model.directory, shapes, env, out, args.seed)
    if not args.no_raw:
        if "single_stream" in wanted:
            print("bench: bare mlx_lm.stream_generate", file=sys.stderr, flush=True)
            results["raw_decode"] = child_json(
                "bench.raw_decode", model.directory, env,
                "--prompt-tokens", shapes.decode_prompt_tokens,
                "--max-tokens", shapes.decode_output_tokens, "--repeats", shapes.decode_repeats)
            if args.tensor_parallel > 1:
                print(f"bench: bare mlx-lm sharded over {args.tensor_parallel} ranks",
                      file=sys.stderr, flush=True)
                results["raw_decode_tp"] = child_json(
                    "bench.raw_decode", model.directory, env,
                    "--prompt-tokens", shapes.decode_prompt_tokens,
                    "--max-tokens", shapes.decode_output_tokens,
                    "--repeats", shapes.decode_repeats,
                    "--tensor-parallel", args.tensor_parallel)
        for name, rounds in raw_rounds.items():
            measured = {**report.median_summary(rounds), "rounds": rounds}
            if name in RAW_BATCH_WORKLOADS:
                results.setdefault("raw_batch", {})[name] = measured
            else:
                results[f"raw_{name}"] = measured
    if not args.no_structured:
        print("bench: constrained vs free decoding", file=sys.stderr, flush=True)
        results["structured"] = child_json(
            "bench.structured", model.directory, env,
            "--prompt-tokens", shapes.so_prompt_tokens,
            "--max-tokens", shapes.so_output_tokens, "--repeats", shapes.so_repeats,
            "--seed", args.seed)
    report.write(results, out, plots=not args.no_plots)
    print((out / "results.md").read_text())
    print(f"bench: wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
