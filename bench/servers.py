"""Starting, watching and stopping the servers under test.

Each server runs in its own process group on a free 127.0.0.1 port, so stopping it takes
every child with it; `running` guarantees the stop on every exit path, and on Linux the
kernel SIGTERMs the server if the benchmark is killed outright. While it runs, a thread
samples the RSS of its whole process tree every 100 ms.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from server.launch.replicas import free_port, router_ready

SAMPLE_SECONDS = 0.1
STOP_SECONDS = 30.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class ServerSpec:
    name: str
    module: str  # run as `python -m module --model DIR --host 127.0.0.1 --port P`
    extra: dict  # request fields this server understands and the other may not
    metrics: bool  # serves radix-mlx's Prometheus /metrics
    notes: str
    command: tuple[str, ...] = ()  # after `-m module`, before --model
    router_workers: int = 0  # > 0: a router in front of this many workers (docs/scale-out.md)
    tensor_parallel: int = 0  # > 1: one server, its model sharded over this many ranks
    args: tuple[str, ...] = ()  # always passed, before any extra flags (which win)
    list_prompts: bool = True  # serves /v1/completions with a list of prompts
    executable: str = ""  # a native server run instead of `python -m module`
    serves_gguf: bool = False  # loads the .gguf file itself, not the converted directory


RADIX = ServerSpec(
    name="radix-mlx",
    module="server",
    # The disk tier is measured by its own workloads (bench/disk_tier.py); here its files
    # from an earlier run would turn a cold workload warm.
    args=("--disk-cache-bytes", "0"),
    extra={"ignore_eos": True},
    metrics=True,
    notes="defaults: max_batch_size 32, prefill_batch_size 8, "
          "prefill_chunk_tokens 2048 on a GPU and 512 on the CPU, prefill_stall_ratio 100 on a "
          "GPU and 0.1 on the CPU, "
          "prefill_stall_floor_ms 20, "
          "radix cache 0.5 of memory minus weights; ignore_eos sent; "
          "disk tier off",
)
MLX_LM = ServerSpec(
    name="mlx-lm",
    module="mlx_lm.server",
    extra={},
    metrics=False,
    notes="defaults: decode_concurrency 32, prompt_concurrency 8, prefill_step_size 2048, "
          "prompt_cache_size 10 sequences, no byte limit; no ignore_eos (stops at EOS); "
          "not run on list prompts (its generation thread crashes on them)",
    list_prompts=False,
)
SPECS = {spec.name: spec for spec in (RADIX, MLX_LM)}
LLAMA_CPP = "llama-cpp"
# Slots for every stream of the CPU workloads at once (batch_decode's 16), one KV pool
# shared by all of them as the default auto mode has it (a fixed split would give each
# slot 1/16 of the context, less than long_context's document).
LLAMA_CPP_ARGS = ("--parallel", "16", "--kv-unified", "--ctx-size", "32768")
# On a GPU: a slot per stream of the GPU workloads (batch_decode's 64), one KV pool for all
# of them (131072 tokens: 16 concurrent 2100-token shared-prefix prompts, or the 6000-token
# document, fit many times over), every layer on the GPU, and --cache-reuse, which its
# docs advise beside prompt caching (a slot reuses chunks of >= 256 cached tokens by
# shifting their KV).
LLAMA_CPP_GPU_ARGS = ("--parallel", "64", "--kv-unified", "--ctx-size", "131072",
                      "--n-gpu-layers", "all", "--cache-reuse", "256")
REPLICA_POLICIES = ("cache_aware", "round_robin")


def llama_cpp(binary: str, gpu: bool = False) -> ServerSpec:
    """llama.cpp's own C++ server (`llama-server`) on the GGUF file the model came from
    (on a GPU, with its CUDA backend: `gpu` picks the GPU flags)."""
    args = LLAMA_CPP_GPU_ARGS if gpu else LLAMA_CPP_ARGS
    version = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=60, check=False)
    built = " ".join(line.strip() for line in (version.stdout + version.stderr).splitlines()
                     if line.startswith(("version", "built with")))
    return ServerSpec(
        name=LLAMA_CPP,
        module="",
        executable=binary,
        serves_gguf=True,
        args=args,
        # Honoured on its OpenAI endpoints too: it reads every native sampling field there.
        extra={"ignore_eos": True},
        metrics=False,
        notes=f"llama-server ({built or 'version unknown'}) on the GGUF file itself (its "
              f"own {'CUDA' if gpu else 'CPU'} kernels), "
              f"{' '.join(args)}; otherwise its defaults: cache_prompt on, "
              "8 GiB host-memory prompt cache (--cache-ram), idle slots saved to it, "
              "threads = cores, flash attention auto, "
              "chat template from the file (jinja); ignore_eos sent; not run on list "
              "prompts (it answers each but its usage counts only the first)",
        list_prompts=False,
    )


def replicas(policy: str, workers: int, cuda_devices: str = "") -> ServerSpec:
    """`radix-mlx replicas`: `workers` radix-mlx servers behind sglang-router's `policy`
    (each on a GPU of its own with `cuda_devices`, e.g. "0,1")."""
    devices = ("--cuda-devices", cuda_devices) if cuda_devices else ()
    return ServerSpec(
        name=f"radix-mlx-x{workers}-{policy.replace('_', '-')}",
        module="server.launch.cli",
        command=("replicas", "--workers", str(workers), "--policy", policy, *devices),
        extra=RADIX.extra,
        metrics=False,
        notes=f"{workers} radix-mlx workers (each with the defaults above) behind "
              f"sglang-router, policy {policy}",
        router_workers=workers,
    )


def tensor_parallel(ranks: int) -> ServerSpec:
    """`radix-mlx serve --tensor-parallel ranks`: one server, the model sharded over
    `ranks` processes (NCCL on CUDA, a GPU each; the ring backend on the CPU)."""
    return ServerSpec(
        name=f"radix-mlx-tp{ranks}",
        module=RADIX.module,
        args=(*RADIX.args, "--tensor-parallel", str(ranks)),
        extra=RADIX.extra,
        metrics=True,
        notes=f"radix-mlx (defaults above) with its model sharded over {ranks} ranks by "
              "mlx-lm's model.shard, started by mlx.launch",
        tensor_parallel=ranks,
    )


class MemorySampler(threading.Thread):
    """Peak RSS of a process and its descendants, sampled every 100 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(SAMPLE_SECONDS):
            self.peak = max(self.peak, self.sample())

    def sample(self) -> int:
        total = 0
        with contextlib.suppress(psutil.Error):
            for process in [self.process, *self.process.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += process.memory_info().rss
        return total

    def take_peak(self) -> int:
        """The peak since the last call; the next interval starts at the current RSS."""
        current = self.sample()
        peak, self.peak = max(self.peak, current), current
        return peak

    def stop(self) -> None:
        self._stop_event.set()


@dataclass
class RunningServer:
    spec: ServerSpec
    base_url: str
    process: subprocess.Popen
    sampler: MemorySampler
    argv: list[str]


def is_ready(base_url: str, router_workers: int = 0) -> bool:
    """/health is 200, or behind a router, it routes to all its workers."""
    if router_workers:
        return router_ready(base_url, router_workers)
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200
    return False


def wait_healthy(process: subprocess.Popen, base_url: str, timeout: float,
                 router_workers: int = 0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready")
        if is_ready(base_url, router_workers):
            return
        time.sleep(0.25)
    raise TimeoutError(f"server at {base_url} not healthy after {timeout:.0f} s")


@contextlib.contextmanager
def running(spec: ServerSpec, model: Path | None, env: dict[str, str], log_path: Path,
            extra_args: Sequence[str] = (), ready_timeout: float = 900.0,
            cwd: Path | None = None) -> Iterator[RunningServer]:
    """Start `spec` on `model` (None: `extra_args` name the models), yield once /health is
    200, and always stop it. `cwd`: the source tree `python -m` runs it from (another
    checkout of radix-mlx, for A/B runs)."""
    port = free_port()
    program = [spec.executable] if spec.executable else [sys.executable, "-m", spec.module]
    argv = [*program, *spec.command, *(["--model", str(model)] if model else []),
            "--host", "127.0.0.1", "--port", str(port), *spec.args,
            *extra_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, cwd=cwd,
                                   preexec_fn=terminated_with_parent())  # noqa: PLW1509
    sampler = MemorySampler(process.pid)
    sampler.start()
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(process, base_url, ready_timeout, spec.router_workers)
        yield RunningServer(spec, base_url, process, sampler, argv)
    finally:
        sampler.stop()
        stop(process)


def terminated_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` asking Linux to SIGTERM the child when this process dies. A server
    runs in its own session, so when a `timeout` or the end of a GPU lease SIGKILLs the
    benchmark, no `finally` stops it: an llama-server left so held 7 GB of an H100 and the
    next run's mlx-lm 8B server ran out of memory. None elsewhere (macOS has no such call).
    prctl is looked up here, before the fork, so the child takes no lock another thread
    could hold: it only calls into libc (hence the lint's fork-with-threads warning is
    waived where this is passed)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after a grace period."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_SECONDS)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


async def scrape_active_memory(client: httpx.AsyncClient, base_url: str) -> int | None:
    """radix-mlx's MLX active memory gauge from /metrics (summed over its models), or None
    if unavailable."""
    try:
        text = (await client.get(f"{base_url}/metrics")).text
    except httpx.HTTPError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("radix_mlx_active_memory_bytes ",
                                  "radix_mlx_active_memory_bytes{"))]
    return int(sum(values)) if values else None
