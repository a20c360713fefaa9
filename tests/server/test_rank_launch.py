"""How `radix-mlx serve --tensor-parallel N` starts its ranks: the mlx.launch command line
it builds, run for real through server/launch/rank_launcher.py with ranks that only report what
they were given. NCCL and other hosts cannot run here, but mlx.launch's nccl backend only
sets environment variables before it starts each rank, so a hostfile that names it on
127.0.0.1 shows which GPU each rank would get."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.distributed import TensorParallelError
from server.config import Settings
from server.launch.env import IN_LAUNCH_ENV
from server.launch.tensor_parallel import launch_command
from tests.server.support import REPO_ROOT, server_env

# A rank that prints what it needs from its launch, one JSON line.
REPORT = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
          "('MLX_RANK', 'CUDA_VISIBLE_DEVICES', 'RADIX_MLX_IN_LAUNCH', "
          "'RADIX_MLX_MAX_BATCH_SIZE', 'UNRELATED')}))")
ENVIRON = {"RADIX_MLX_MAX_BATCH_SIZE": "3", "UNRELATED": "x"}


def hostfile(tmp_path: Path, hosts: list[str], backend: str = "ring") -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"backend": backend, "hosts": [
        {"ssh": host, "ips": ["127.0.0.1"]} for host in hosts]}))
    return path


def run_ranks(command: list[str]) -> list[dict]:
    """Each rank's report, in rank order."""
    result = subprocess.run(command, cwd=REPO_ROOT, env=server_env(ENVIRON),
                            stdin=subprocess.PIPE, capture_output=True, text=True,
                            timeout=60, check=True)
    # mlx.launch passes each rank's output on in chunks, so two reports may share a line.
    reports = [json.loads(report) for report in re.findall(r"\{[^{}]*\}", result.stdout)]
    return sorted(reports, key=lambda report: report["MLX_RANK"])


def test_ranks_on_this_host_inherit_our_environment_and_are_marked_as_ranks() -> None:
    command = launch_command(Settings(tensor_parallel=2), ["-c", REPORT], ENVIRON)
    assert command[command.index("--") + 1] == sys.executable  # whatever the backend
    assert "RADIX_MLX_MAX_BATCH_SIZE=3" not in command  # inherited, not on a command line
    reports = run_ranks(command)
    assert [r["MLX_RANK"] for r in reports] == ["0", "1"]
    assert all(r[IN_LAUNCH_ENV] == "1" and r["RADIX_MLX_MAX_BATCH_SIZE"] == "3"
               for r in reports)


def test_hostfile_ranks_get_our_settings_environment_and_nothing_else(
        tmp_path: Path) -> None:
    """Ranks on other hosts start from their own login environment: mlx.launch exports
    our settings' variables on each."""
    settings = Settings(tensor_parallel=2, hostfile=hostfile(tmp_path, ["127.0.0.1"] * 2))
    command = launch_command(settings, ["-c", REPORT], ENVIRON)
    assert command[command.index("RADIX_MLX_MAX_BATCH_SIZE=3") - 1] == "--env"
    assert "UNRELATED=x" not in command
    reports = run_ranks(command)
    assert [(r["MLX_RANK"], r["RADIX_MLX_MAX_BATCH_SIZE"], r[IN_LAUNCH_ENV])
            for r in reports] == [("0", "3", "1"), ("1", "3", "1")]


def test_nccl_ranks_listed_together_on_a_host_get_a_gpu_each(tmp_path: Path) -> None:
    """mlx.launch gives hostfile rank r the GPU r mod its -n, which is 1 unless given:
    without our -n both ranks of this host would get GPU 0."""
    settings = Settings(tensor_parallel=2,
                        hostfile=hostfile(tmp_path, ["127.0.0.1"] * 2, backend="nccl"))
    command = launch_command(settings, ["-c", REPORT], ENVIRON)
    assert [r["CUDA_VISIBLE_DEVICES"] for r in run_ranks(command)] == ["0", "1"]
    two_hosts = Settings(tensor_parallel=4, hostfile=hostfile(
        tmp_path, ["mac1", "mac1", "mac2", "mac2"], backend="nccl"))
    command = launch_command(two_hosts, ["-c", REPORT], ENVIRON)
    assert command[command.index("-n") + 1] == "2"


# Rank 0 waits for a signal; rank 1 exits with an error once rank 0 listens for it.
SIGNALLED = """
import os, signal, sys, time
from pathlib import Path
ready = Path(sys.argv[1])
if os.environ["MLX_RANK"] == "0":
    signal.signal(signal.SIGUSR1, lambda signum, frame: sys.exit(print("rank 0: SIGUSR1")))
    ready.touch()
    time.sleep(30)
    print("rank 0: no signal")
else:
    while not ready.exists():
        time.sleep(0.05)
    sys.exit(1)
"""


def test_a_rank_that_exits_with_an_error_is_told_to_the_others_by_sigusr1(
        tmp_path: Path) -> None:
    """The ring backend may never notice a lost peer (a rank waiting to receive from it
    spins), and mlx.launch's own SIGTERM would start rank 0's drain: the ranks left hear
    SIGUSR1, on which they fail their engine (server/launch/tensor_parallel.py)."""
    command = launch_command(Settings(tensor_parallel=2),
                             ["-c", SIGNALLED, str(tmp_path / "ready")], ENVIRON)
    result = subprocess.run(command, cwd=REPO_ROOT, env=server_env(ENVIRON),
                            stdin=subprocess.PIPE, capture_output=True, text=True,
                            timeout=60, check=False)
    assert "rank 0: SIGUSR1" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize(("hosts", "backend", "message"), [
    (["127.0.0.1"] * 3, "ring", "lists 3 ranks but --tensor-parallel is 2"),
    (["a", "b", "a", "b"], "nccl", "every host is listed the same number of times"),
    (["a", "a", "a", "b"], "nccl", "every host is listed the same number of times"),
])
def test_a_hostfile_that_cannot_give_the_ranks_is_refused_before_the_launch(
        tmp_path: Path, hosts: list[str], backend: str, message: str) -> None:
    settings = Settings(tensor_parallel=2 if len(hosts) == 3 else 4,
                        hostfile=hostfile(tmp_path, hosts, backend))
    with pytest.raises(TensorParallelError, match=message):
        launch_command(settings, ["-c", REPORT], ENVIRON)


def test_a_missing_hostfile_is_named(tmp_path: Path) -> None:
    settings = Settings(tensor_parallel=2, hostfile=tmp_path / "absent.json")
    with pytest.raises(TensorParallelError, match="absent.json doesn't exist"):
        launch_command(settings, ["-c", REPORT], ENVIRON)
