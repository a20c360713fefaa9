"""A service manager's stop: the server started with the exact command line of the
rendered launchd plist / systemd unit drains on SIGTERM, lets a running stream finish
and exits 0 before the manager would SIGKILL it."""

from __future__ import annotations

import json
import os
import plistlib
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import httpx
import pytest
from uvicorn.server import STARTUP_FAILURE

from engine.model_source import default_model_file
from server.launch.replicas import free_port
from server.launch.service_files import render_launchd, render_systemd, stop_timeout
from tests.server.support import without_torch

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DRAIN_TIMEOUT = 8


def write_config(directory: Path, model_dir: Path) -> tuple[Path, int]:
    port = free_port()
    config = directory / "config.toml"
    config.write_text(
        f'model = "{model_dir}"\nport = {port}\ndrain_timeout = {DRAIN_TIMEOUT}\n'
        f"cache_bytes = {64 * 2**20}\n"
        f'disk_cache_dir = "{directory / "kv"}"\n'  # the service's disk tier, kept in tmp
    )
    return config, port


def launchd_command(config: Path, logs: Path) -> tuple[list[str], dict[str, str]]:
    plist = plistlib.loads(render_launchd(
        DEPLOY / "launchd" / "dev.radix-mlx.server.plist",
        executable=Path(sys.executable).with_name("radix-mlx"),
        config_path=config, log_dir=logs,
    ).encode())
    return plist["ProgramArguments"], plist["EnvironmentVariables"]


def systemd_command(config: Path, logs: Path) -> tuple[list[str], dict[str, str]]:
    unit = render_systemd(DEPLOY / "systemd" / "radix-mlx.service",
                          executable=Path(sys.executable).with_name("radix-mlx"),
                          config_path=config)
    lines = dict(line.split("=", 1) for line in unit.splitlines() if line.startswith(
        ("ExecStart=", "Environment=")))
    env = dict(item.split("=", 1) for item in shlex.split(lines["Environment"]))
    return shlex.split(lines["ExecStart"]), env


@pytest.mark.parametrize("render", [launchd_command, systemd_command],
                         ids=["launchd", "systemd"])
def test_sigterm_lets_the_stream_finish_and_exits_zero(render, demo_model_dir, tmp_path):
    config, port = write_config(tmp_path, demo_model_dir)
    command, service_env = render(config, tmp_path / "logs")
    assert Path(command[0]).is_absolute()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIX_MLX_")}
    env.update(service_env)
    env["PYTHONPATH"] = without_torch(env.get("PYTHONPATH"))  # as installed: no torch
    log = (tmp_path / "stdout.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process)
        body = {"model": demo_model_dir.name, "prompt": "Once upon a time", "stream": True,
                "max_tokens": 600, "ignore_eos": True, "temperature": 0}
        chunks = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    break
            process.send_signal(signal.SIGTERM)
            stopped_at = time.monotonic()
            chunks += [line[6:] for line in lines if line.startswith("data: ")]
        assert chunks[-1] == "[DONE]"
        finals = [json.loads(c)["choices"][0]["finish_reason"] for c in chunks[:-1]]
        assert finals[-1] == "length"
        assert process.wait(timeout=stop_timeout(config)) == 0
        assert time.monotonic() - stopped_at < stop_timeout(config)
    finally:
        if process.poll() is None:
            process.kill()
        log.close()


def wait_ready(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, "server exited during start-up"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("server not ready")


def start_stage(tmp_path: Path, model: Path | None,
                env: Mapping[str, str] = MappingProxyType({}),
                entry: tuple[str, ...] = ("server",),
                flags: tuple[str, ...] = ("--disk-cache-bytes", "0"),
                ) -> tuple[subprocess.Popen, Path, str]:
    """A server of `model` (None: `flags` name the models) started as `python -m server`
    (or `entry`), without torch as installed (tests/server/without_torch): the process,
    its log and its URL."""
    log = tmp_path / "server.log"
    port = free_port()
    command = [sys.executable, "-m", *entry, *(["--model", str(model)] if model else []),
               "--port", str(port), "--config", "", *flags]
    pythonpath = without_torch(os.environ.get("PYTHONPATH"))
    with log.open("w") as out:
        process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": pythonpath, **env},
                                   stdout=out, stderr=subprocess.STDOUT)
    return process, log, f"http://127.0.0.1:{port}"


def wait_for(condition, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert process.poll() is None, f"exited before {what}"
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.02)


def stop_when(condition, process: subprocess.Popen, log: Path, what: str) -> None:
    """SIGTERM once `condition()` holds: the process must exit 0, without the abort
    (exit 134, "terminate called without an active exception") that a service manager
    counts as a crash."""
    try:
        wait_for(condition, process, what)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text()
        assert "terminate called" not in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()


def probe(url: str, read):
    """`read` of a GET of `url`'s JSON, or None while the server does not answer it."""
    try:
        return read(httpx.get(url, timeout=1).json())
    except (httpx.TransportError, ValueError, KeyError, IndexError):
        return None


@pytest.mark.parametrize("stage", ["loading", "warming_up"])
def test_sigterm_while_the_model_loads_or_warms_up_exits_zero(stage, real_model_dir, tmp_path):
    """The engine's thread is inside MLX then. The warm-up forced on, as a GPU runs it:
    on a CPU the engine does not warm up, and the stage would last milliseconds."""
    process, log, url = start_stage(tmp_path, real_model_dir,
                                    flags=("--disk-cache-bytes", "0", "--warm-up", "on"))
    stop_when(lambda: probe(f"{url}/health", lambda h: h["status"]) == stage, process, log,
              stage)


def test_a_port_in_use_is_an_error_exit_not_an_abort(real_model_dir, tmp_path):
    """uvicorn cannot bind while the engine's thread is inside MLX, loading the model: the
    exit must be uvicorn's start-up failure (3) with its reason, not std::terminate's abort
    (134)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process, log, _ = start_stage(tmp_path, real_model_dir, flags=(
            "--disk-cache-bytes", "0", "--port", str(port)))
        try:
            assert process.wait(timeout=120) == STARTUP_FAILURE, log.read_text()
        finally:
            if process.poll() is None:
                process.kill()
    assert "address already in use" in log.read_text()
    assert "terminate called" not in log.read_text()


def test_sigterm_while_a_gguf_is_converted_exits_zero_and_publishes_nothing(tmp_path):
    """Converting comes before any port opens: the stop ends it, and the half-written
    conversion is never taken for a model."""
    cache = tmp_path / "cache"
    process, log, _ = start_stage(tmp_path, default_model_file(),
                                  {"XDG_CACHE_HOME": str(cache)})
    stop_when(lambda: "converting" in log.read_text(), process, log, "converting")
    assert not list(cache.glob("radix-mlx/gguf/*/*/config.json"))


def test_sigterm_while_the_disk_tier_is_restored_exits_zero(demo_model_dir, tmp_path):
    """The engine serves while its tree is rebuilt from the disk tier's files (slowed down
    here, as a tier of many files is): a stop then drains and exits 0. The rebuild's
    window is the slowdown's, so the demo model (warm in a second) does."""
    flags = ("--disk-cache-dir", str(tmp_path / "kv"), "--disk-cache-bytes", str(2**30))
    process, log, url = start_stage(tmp_path, demo_model_dir,
                                    entry=("tests.slow_rebuild", "60"), flags=flags)
    stop_when(lambda: probe(f"{url}/admin/cache", lambda c: c["disk"]["rebuilding"]),
              process, log, "restoring the disk tier")


def test_sigterm_while_one_of_several_models_loads_exits_zero(real_model_dir, tmp_path):
    """With several models, each loads in an engine process of its own."""
    models = tmp_path / "models.toml"
    models.write_text(f'[[models]]\nid = "smol"\nsource = "{real_model_dir}"\n'
                      "pinned = true\n[[models]]\nid = \"other\"\n"
                      f'source = "{real_model_dir}"\n')
    process, log, url = start_stage(tmp_path, None, flags=(
        "--models-file", str(models), "--disk-cache-bytes", "0"))
    stop_when(lambda: probe(f"{url}/health", lambda h: h["models"][0]["state"]) == "loading",
              process, log, "loading")
