"""Images in multi-turn conversations: radix-mlx against mlx-vlm's own server.

`python -m bench.vision`: 8 conversations x 4 turns at once, each about one image of its
own that every turn sends again (a chat about a screenshot), on a random Gemma 3 vision
model (`make-demo-model --family gemma3-vision`) of a demo size or, with `--size 4b`, of
Gemma 3 4B's shape in bfloat16 (a GPU's run: `bash bench/gpu.sh --vision OUT`). Servers,
one at a time, a fresh start each: radix-mlx; `mlx_vlm.server` one sequence at a time
(its batches of image prompts fail), its prefix cache off (its default) and on
(`APC_ENABLED=1`). The figures: TTFT p50 of turns 2-4 (the ones a cache can serve) and
the share of their prompt tokens served from the cache; the target is radix-mlx at <= 0.3x
mlx-vlm's TTFT with >= 85% cached.

Then the same conversations without images, on radix-mlx serving the vision model's
folder and serving its language model alone as a text model (the same weights, written by
mlx-lm): text-only traffic to a vision model should cost what it costs on the text model.
The bench process itself never imports MLX (the models are built in a child).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from bench import hardware, report
from bench.client import run_workload
from bench.servers import RADIX, ServerSpec, running
from bench.workloads import Conversation, Workload
from engine.demo_vlm import VISION
from engine.platform_info import cpu_reexec_env, mlx_would_use_cpu

RESULTS = Path(__file__).parent / "results"
QUESTIONS = ("What does this screenshot show? Describe the layout.",
             "Which element on the left stands out, and why?",
             "Rewrite the title so it is clearer.",
             "List three things a user would click first.")
# Its continuous batching fails a batch of Gemma 3 image prompts of unequal lengths
# (mlx-vlm 0.7.10: `_merge_prefill_prompt_kwargs` concatenates their (1, 1, n, n) attention
# masks), failing every request in it: one sequence at a time is how it serves them.
MLX_VLM = ServerSpec(name="mlx-vlm", module="mlx_vlm.server", extra={}, metrics=False,
                     args=("--max-num-seqs", "1"),
                     notes="--max-num-seqs 1 (batched image prompts of unequal lengths "
                           "fail in 0.7.10); otherwise defaults: its prefix cache (APC) off; "
                           "no ignore_eos (stops at EOS)")
MLX_VLM_APC = ServerSpec(name="mlx-vlm-apc", module="mlx_vlm.server", extra={},
                         metrics=False, args=MLX_VLM.args,
                         notes="as mlx-vlm, with APC_ENABLED=1: its automatic prefix cache on")
TEXT_MODEL = ServerSpec(name="radix-mlx-text-model", module=RADIX.module, extra=RADIX.extra,
                        metrics=True, args=RADIX.args,
                        notes="radix-mlx on the language model alone, saved as a text model")
BUILD = """
import json, shutil, sys
from pathlib import Path
from engine.demo_vlm import build_demo_vlm
vision, text = Path(sys.argv[1]), Path(sys.argv[2])
build_demo_vlm(vision, size=sys.argv[3])
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load
model, _ = load(str(vision))
text.mkdir(parents=True, exist_ok=True)
mx.save_safetensors(str(text / "model.safetensors"),
                    dict(tree_flatten(model.language_model.parameters())),
                    metadata={"format": "mlx"})
config = json.loads((vision / "config.json").read_text())
language = {**config["text_config"], "eos_token_id": config["eos_token_id"],
            "bos_token_id": config["bos_token_id"], "pad_token_id": config["pad_token_id"]}
(text / "config.json").write_text(json.dumps(language))
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(vision / name, text / name)
"""


def image_url(seed: int) -> str:
    """A 320x240 PNG of smooth random colour (a screenshot-sized picture), as a data: URL."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    picture = Image.fromarray(coarse).resize((320, 240), Image.Resampling.BILINEAR)
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}"


def workload(conversations: int, turns: int, max_tokens: int, images: bool,
             seed: int) -> Workload:
    """Each conversation's first turn shows its image (resent with the history every
    turn); the questions differ by conversation so only the image and the history repeat."""
    chats = []
    for index in range(conversations):
        asks = [f"{QUESTIONS[turn % len(QUESTIONS)]} (conversation {index})"
                for turn in range(turns)]
        first = ([{"type": "image_url", "image_url": {"url": image_url(seed + index)}},
                  {"type": "text", "text": asks[0]}] if images else asks[0])
        chats.append(Conversation(None, (first, *asks[1:])))
    return Workload("image_multi_turn" if images else "text_multi_turn", tuple(chats),
                    concurrency=conversations, max_tokens=max_tokens)


def summarize(requests: list[dict], wall_seconds: float) -> dict:
    """TTFT of turns 2+ and of first turns; of turns 2+, the share of prompt tokens from
    the cache, and the share of the previous turn's prompt (the image and the history
    before the last reply) from the cache. They differ by the last reply: a random model's
    tokens, detokenized and encoded again with the next turn, are often others (and the
    template trims the reply), so what follows in the turn misses."""
    done = [r for r in requests if r["error"] is None]
    later = [r for r in done if r["turn"] > 0 and r["cached_tokens"] is not None]
    previous = {(r["conversation"], r["turn"] + 1): r["prompt_tokens"] for r in done}
    return {
        "requests": len(requests), "errors": len(requests) - len(done), "wall_s": wall_seconds,
        "ttft_p50_later_turns": report.percentile(
            [r["ttft"] for r in done if r["turn"] > 0], 50),
        "ttft_p50_first_turn": report.percentile(
            [r["ttft"] for r in done if r["turn"] == 0], 50),
        "cached_share_later_turns": (sum(r["cached_tokens"] for r in later)
                                     / sum(r["prompt_tokens"] for r in later)
                                     if later else None),
        "previous_prompt_cached": (
            sum(min(r["cached_tokens"], previous[r["conversation"], r["turn"]]) for r in later)
            / sum(previous[r["conversation"], r["turn"]] for r in later) if later else None),
        "prompt_tokens": sum(r["prompt_tokens"] for r in done),
        "completion_tokens": sum(r["completion_tokens"] for r in done),
        "requests_detail": requests,
    }


def measure(spec: ServerSpec, model: Path, work: Workload, env: dict[str, str],
            out: Path) -> dict:
    # mlx-vlm's server needs the model named in every request; radix-mlx takes its default.
    extra = spec.extra | ({"model": str(model)} if spec.module == MLX_VLM.module else {})
    # Warmed up with the workload's own kind of turn: an image request before text-only
    # traffic left the vision model's tree a snapshot the text model's could not have,
    # which changed which first turns shared their head (TTFT 1.1 against 0.55 s on the
    # CPU).
    images = not isinstance(work.conversations[0].user_turns[0], str)
    warm_up = workload(1, 1, 4, images, 10_000)
    with running(spec, model, env, out / f"{spec.name}-{work.name}.log") as server:
        asyncio.run(run_workload(server.base_url, warm_up, extra))
        run = asyncio.run(run_workload(server.base_url, work, extra))
    return summarize([r.as_dict() for r in run.requests], run.wall_seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="bench", choices=sorted(VISION))
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="build the models in a temporary directory here (default: "
                             "the system's; the 4b pair takes 17 GB)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report", type=Path, default=None,
                        help="only write results.md again from this results.json")
    args = parser.parse_args()
    if args.report is not None:
        result = json.loads(args.report.read_text())
        hardware_line = args.report.with_name("results.md").read_text().split("\n")[:3]
        args.report.with_name("results.md").write_text(
            "\n".join([*hardware_line, *table(result), ""]))
        return 0
    env = cpu_reexec_env() or dict(os.environ)
    device = "cpu" if mlx_would_use_cpu() else "gpu"
    out = args.out or RESULTS / hardware.tag(device) / f"vision-{args.size}"
    runs: dict = {}
    if args.models_dir is not None:
        args.models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.models_dir) as directory:
        vision, text = Path(directory) / "vision", Path(directory) / "text"
        subprocess.run([sys.executable, "-c", BUILD, str(vision), str(text), args.size],
                       env=env, check=True)
        images = workload(args.conversations, args.turns, args.max_tokens, True, args.seed)
        plain = workload(args.conversations, args.turns, args.max_tokens, False, args.seed)
        for spec, model, work, spec_env in (
                (RADIX, vision, images, env), (MLX_VLM, vision, images, env),
                (MLX_VLM_APC, vision, images, env | {"APC_ENABLED": "1"}),
                (RADIX, vision, plain, env), (TEXT_MODEL, text, plain, env)):
            key = f"{spec.name}/{work.name}"
            print(f"{key} ...", flush=True)
            runs[key] = measure(spec, model, work, spec_env, out)
            print(key, {k: v for k, v in runs[key].items() if k != "requests_detail"},
                  flush=True)
    notes = {spec.name: spec.notes for spec in (RADIX, MLX_VLM, MLX_VLM_APC, TEXT_MODEL)}
    hardware.write_results(out, "bench.vision", device, "Images in multi-turn conversations",
                           {"runs": runs, "servers": notes}, table)
    print((out / "results.md").read_text())
    return 0


def table(result: dict) -> list[str]:
    runs = result["runs"]
    rows = ["", f"`{result['command']}`", "",
            ("| server | workload | TTFT p50 turns 2-4 (s) | TTFT p50 turn 1 (s) | "
             "cached share turns 2-4 | previous turn's prompt cached | wall (s) | failed |"),
            "|---|---|---|---|---|---|---|---|"]
    for key, run in runs.items():
        server, name = key.split("/")
        summary = summarize(run["requests_detail"], run["wall_s"])

        def share(value: float | None) -> str:
            return "-" if value is None else f"{value:.0%}"

        def seconds(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        rows.append(f"| {server} | {name} | {seconds(summary['ttft_p50_later_turns'])} | "
                    f"{seconds(summary['ttft_p50_first_turn'])} | "
                    f"{share(summary['cached_share_later_turns'])} | "
                    f"{share(summary['previous_prompt_cached'])} | {summary['wall_s']:.1f} | "
                    f"{summary['errors']} |")
    rows.append("")
    radix = runs.get("radix-mlx/image_multi_turn")
    for peer in ("mlx-vlm", "mlx-vlm-apc"):
        other = runs.get(f"{peer}/image_multi_turn")
        if radix and other and other["ttft_p50_later_turns"]:
            ratio = radix["ttft_p50_later_turns"] / other["ttft_p50_later_turns"]
            rows.append(f"- TTFT p50 of turns 2-4, radix-mlx / {peer}: {ratio:.2f}x")
    vlm = runs.get("radix-mlx/text_multi_turn")
    lm = runs.get("radix-mlx-text-model/text_multi_turn")
    if vlm and lm:
        rows.append(f"- text-only traffic, vision model / text model: wall "
                    f"{vlm['wall_s'] / lm['wall_s']:.2f}x, TTFT p50 turns 2-4 "
                    f"{vlm['ttft_p50_later_turns'] / lm['ttft_p50_later_turns']:.2f}x")
    rows += ["", *(f"- {name}: {notes}" for name, notes in result["servers"].items())]
    return rows


if __name__ == "__main__":
    sys.exit(main())
