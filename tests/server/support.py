"""Starting real server processes (`python -m server`) for the tests."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.platform_info import cpu_env
from server.launch.replicas import free_port

API_KEY = "test-key-123"
ALIAS = "demo-alias"
REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 120.0


def model_variant(model_dir: Path, target: Path,
                  settings: Mapping[str, Mapping[str, Any]]) -> Path:
    """A copy of `model_dir` at `target` whose JSON files (by name) get `settings`' keys."""
    shutil.copytree(model_dir, target)
    for name, changes in settings.items():
        values = json.loads((target / name).read_text())
        values.update(changes)
        (target / name).write_text(json.dumps(values))
    return target


def capabilities_before_first_load(model_dir: Path, directory: Path) -> list[str]:
    """/api/show's capabilities of a copy of `model_dir` never loaded: the second of two
    models a server in `directory` serves, each loaded on its first request."""
    first, second = (model_variant(model_dir, directory / name, {})
                     for name in ("first", "second"))
    process = start_server(None, directory / "server.log", "--model", str(first),
                           "--model", str(second))
    try:
        shown = httpx.post(f"{process.url}/api/show", json={"model": "second"}, timeout=30)
        assert shown.status_code == 200, shown.text
        return shown.json()["capabilities"]
    finally:
        process.stop()


def read_metrics(url: str, api_key: str | None = None,
                 verify: ssl.SSLContext | bool = True) -> dict[str, float]:
    """A one-model server's series of /metrics, by name (unlabelled, or labelled by model
    alone), read with prometheus_client's parser."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(f"{url}/metrics", headers=headers, verify=verify, timeout=10).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if set(sample.labels) <= {"model"}
    }


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log_path: Path
    api_key: str | None = None
    verify: ssl.SSLContext | bool = True  # trusts a TLS server's own certificate

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def access_line(self, request_id: str, timeout: float = 10.0) -> str:
        """The access-log line of `request_id`. The server writes it once the response has
        gone out, so a client that has read the response may be there first: wait for it."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log().splitlines():
                if request_id in line and "radix_mlx.access" in line:
                    return line
            if time.monotonic() > deadline:
                raise AssertionError(f"no access-log line for {request_id} in {timeout} s")
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        return read_metrics(self.url, self.api_key, self.verify)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout=60)


# Its sitecustomize hides torch from the processes (the folder says why).
WITHOUT_TORCH = Path(__file__).parent / "without_torch"


def server_env(extra: Mapping[str, str] = {}) -> dict[str, str]:
    """This process's environment without the developer's RADIX_MLX_* settings (they must
    not leak into the tests), with OpenBLAS at its best kernels and without torch, as
    installed (tests/server/without_torch), plus `extra`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("RADIX_MLX_")}
    return {**env, **cpu_env(env), "PYTHONPATH": without_torch(env.get("PYTHONPATH")),
            **extra}


def without_torch(pythonpath: str | None) -> str:
    """`pythonpath` (a PYTHONPATH's value, or None) with tests/server/without_torch first."""
    return os.pathsep.join([str(WITHOUT_TORCH), *filter(None, [pythonpath])])


def start_server(
    model_dir: Path | None, log_path: Path, *flags: str, env: Mapping[str, str] = {},
    fault_token: int | None = None, cache_bytes: int | None = 256 * 2**20,
    hang_token: int | None = None, entry: Sequence[str] = ("server",),
) -> ServerProcess:
    """A ready server on a free port; stopped again if it does not become ready. With a
    `fault_token`, every forward pass that feeds it fails, with a `hang_token` every one
    that feeds it never ends (tests/faults.py); `entry` is the module run and its first
    arguments otherwise (`("tests.slow_rebuild", "5")`, say). Its disk cache
    tier is off unless `flags` turn it on (`--disk-cache-bytes`); its prefix cache gets
    `cache_bytes` (None: what the memory plan gives it). No `model_dir`: `flags` name the
    models (a models file)."""
    port = free_port()
    if fault_token is not None:
        entry = ("tests.faults", str(fault_token))
    elif hang_token is not None:
        entry = ("tests.faults", f"hang:{hang_token}")
    model = [] if model_dir is None else ["--model", str(model_dir)]
    command = [
        sys.executable, "-m", *entry, *model, "--port", str(port),
        "--config", "", *(["--cache-bytes", str(cache_bytes)] if cache_bytes else []),
        "--disk-cache-bytes", "0", *flags,
    ]
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=server_env(env), stdout=log, stderr=subprocess.STDOUT
        )
    def flag(name: str) -> str | None:
        return flags[flags.index(name) + 1] if name in flags else None

    certfile = flag("--ssl-certfile")
    server = ServerProcess(f"{'https' if certfile else 'http'}://127.0.0.1:{port}", process,
                           log_path, flag("--api-key"),
                           ssl.create_default_context(cafile=certfile) if certfile else True)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            health = httpx.get(f"{server.url}/health", verify=server.verify, timeout=2)
            if health.status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not ready after {START_TIMEOUT} s:\n{server.log()}")


def wait_idle(server: ServerProcess, timeout: float = 60.0) -> dict[str, float]:
    """/metrics once nothing runs, waits, is pinned or is pending (a reply's next-turn
    guess included, from the moment the reply ends), or at the timeout: the caller's
    assertions then say what was left."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        busy = (metrics["radix_mlx_running_requests"], metrics["radix_mlx_background_prefills"],
                metrics["radix_mlx_model_next_turn_guesses"],
                metrics["radix_mlx_queue_depth"], metrics["radix_mlx_tree_pinned_bytes"],
                metrics["radix_mlx_tree_pending_nodes"])
        if not any(busy) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)
