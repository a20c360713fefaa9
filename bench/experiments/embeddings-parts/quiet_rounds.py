"""The embeddings bench, before and after a change, on a machine other people also use:
each round starts once the machine has been idle for 8 s, runs at nice -20, and is kept
only if the rest of the machine used under 4% of its CPU meanwhile (/proc/stat's busy time
less the bench's own). torch's two OpenMP threads slow 3-5x when a third process takes a
core even briefly, so a contended round says nothing about the ratio.

usage: python quiet_rounds.py ROUNDS BEFORE_TREE AFTER_TREE OUT_DIR
       (run from anywhere; each tree a checkout whose `python -m bench` is measured)
"""

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

PYTHON = sys.executable
MODEL = "/root/.cache/radix-mlx/demo-models/tiny-seed0"  # ignored by the embeddings workload
IDLE = 0.05
OTHERS = 0.04


def busy_seconds() -> float:
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_idle(limit: float = 1800.0) -> None:
    started = time.time()
    while time.time() - started < limit:
        before = busy_seconds()
        time.sleep(8)
        if (busy_seconds() - before) / 8 / os.cpu_count() < IDLE:
            return


def round_of(tree: Path, out: Path, env: dict[str, str]) -> tuple[dict, float]:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine_before = usage.ru_utime + usage.ru_stime
    busy_before, started = busy_seconds(), time.time()
    with (out.parent / f"{out.name}.log").open("w") as log:
        subprocess.run(["nice", "-n", "-20", PYTHON, "-m", "bench", "--model", MODEL,
                        "--workloads", "embeddings", "--servers", "radix-mlx", "--no-raw",
                        "--no-plots", "--no-structured", "--out", str(out)],
                       cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = usage.ru_utime + usage.ru_stime - mine_before
    others = (busy_seconds() - busy_before - mine) / ((time.time() - started) * os.cpu_count())
    return json.loads((out / "results.json").read_text())["prefill_endpoints"]["embeddings"], others


def main(rounds: int, before: Path, after: Path, out_dir: Path) -> None:
    env = dict(os.environ)
    added = subprocess.run([PYTHON, "-m", "engine.platform_info"], capture_output=True,
                           text=True, cwd=after, check=True).stdout.split()
    env.update(item.split("=", 1) for item in added)
    trees = {"before": before, "after": after}
    kept: dict[str, list[float]] = {side: [] for side in trees}
    for attempt in range(1, rounds * 20 + 1):
        if min(map(len, kept.values())) >= rounds:
            break
        side = min(trees, key=lambda name: len(kept[name]))  # before first on a tie
        wait_idle()
        result, others = round_of(trees[side], out_dir / f"{side}-{attempt}", env)
        keep = others < OTHERS
        print(f"{side} {attempt}: {result['sentences_s']:.1f} sentences/s against "
              f"{result['reference_sentences_s']:.1f} ({result['ratio']:.3f}x), lowest cosine "
              f"{result['min_cosine']:.7f}; others {others:.1%}: "
              f"{'kept' if keep else 'discarded'}", flush=True)
        if keep:
            kept[side].append(result["ratio"])
    print(json.dumps(kept))


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
