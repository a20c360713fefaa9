"""A service manager's stop: the server started with the exact command line of the
rendered launchd plist / systemd unit drains on SIGTERM, lets a running stream finish
and exits 0 before the manager would SIGKILL it."""

from __future__ import annotations

import json
import os
import plistlib
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.replicas import free_port
from server.service_files import render_launchd, render_systemd, stop_timeout

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
