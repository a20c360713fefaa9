"""Medians over repeated runs of `python -m bench`, for comparing code versions.

    python -m bench.medians OUT before=RUN1 after=RUN2 before=RUN3 after=RUN4 ...

Each RUN is a results folder (its results.json); a label names the code that ran it
(runs of one label are repeats). One run is noise on a shared machine, so a claim of
before/after rests on the median of alternating runs. Writes OUT/medians.md and
OUT/medians.json: per workload, label and server, the median of each number and every
run's value beside it, with each run's commit and command.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# (summary key, label, format)
NUMBERS = (
    ("ttft_p50", "TTFT p50 (s)", "{:.2f}"),
    ("itl_p50", "ITL p50 (ms)", "{:.0f}"),
    ("output_tok_s", "output tok/s", "{:.1f}"),
    ("ttft_p99", "TTFT p99 (s)", "{:.2f}"),
)


def collect(runs: list[tuple[str, Path]]) -> dict:
    """{workload: {"label / server": {key: [value per run]}}}, in run order."""
    table: dict = {}
    for label, folder in runs:
        results = json.loads((folder / "results.json").read_text())
        for server, entry in results["servers"].items():
            for workload, summary in entry["workloads"].items():
                row = table.setdefault(workload, {}).setdefault(f"{label} / {server}", {})
                for key, _, _ in NUMBERS:
                    if summary.get(key) is not None:
                        row.setdefault(key, []).append(summary[key])
    return table


def render(table: dict, runs: list[tuple[str, Path]]) -> str:
    lines = ["# Medians of repeated runs", ""]
    for workload, rows in table.items():
        lines += [f"## {workload}", "",
                  "| code / server | runs | " + " | ".join(t for _, t, _ in NUMBERS) + " |",
                  "|---|---:|" + "---:|" * len(NUMBERS)]
        for name, values in rows.items():
            cells = []
            for key, _, fmt in NUMBERS:
                got = values.get(key, [])
                cells.append(f"{fmt.format(statistics.median(got))} "
                             f"({', '.join(fmt.format(v) for v in got)})" if got else "n/a")
            count = max(map(len, values.values()), default=0)
            lines.append(f"| {name} | {count} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Each cell: the median (every run's value, in run order).", "", "## Runs", ""]
    for label, folder in runs:
        results = json.loads((folder / "results.json").read_text())
        lines.append(f"- {label}: `{folder.name}`, code {results.get('git')}, "
                     f"`{results.get('command')}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.medians",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN")
    args = parser.parse_args(argv)
    runs = []
    for item in args.runs:
        label, sep, folder = item.partition("=")
        if not sep or not label:
            parser.error(f"expected LABEL=RUN, got {item!r}")
        runs.append((label, Path(folder)))
    table = collect(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "medians.json").write_text(json.dumps(table, indent=1) + "\n")
    text = render(table, runs)
    (args.out / "medians.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
