"""A server log's step trace (`--log-level debug`) as CSV: one line per engine step, its
time, rows, rows that verified drafts, prompt tokens fed and milliseconds.

    python bench/experiments/speculation-engine/step_trace.py LOG [LOG ...] > steps.csv

The first column names the log each step came from.
"""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

STEP = re.compile(r"^\S+ (\S+) DEBUG radix_mlx\.engine: step: (\d+) rows \((\d+) verified\), "
                  r"(\d+) prompt tokens fed, \d+ prompts left, ([\d.]+) ms")


def main() -> None:
    out = csv.writer(sys.stdout)
    out.writerow(["log", "time", "rows", "verified", "prompt_tokens", "ms"])
    for path in map(Path, sys.argv[1:]):
        for line in path.read_text().splitlines():
            if match := STEP.match(line):
                out.writerow([path.stem, *match.groups()])


if __name__ == "__main__":
    main()
