"""Replay drafting policies over a model's own greedy answers (no model in the loop).

    PYTHONPATH=. python bench/experiments/speculation-draft-length/replay.py MODEL

Greedy output does not depend on speculation, so how many verify and decode steps a
drafting policy needs for an answer can be counted offline: generate the agent edit
workload's single-stream answers once with bare mlx-lm, then walk each answer with the
engine's own `Drafts` (prompt lookup), keeping at each verify the longest prefix of the
draft that the answer continues with. A step's cost is `StepCost["gpu"]` for one row.
Prints one JSON object per policy: steps, tokens per verify, and the modelled speed-up
over decoding one token a step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlx_lm import load, stream_generate

from bench.speculation import agent_requests
from bench.workloads import Shapes, TextSource
from engine import speculation


def answers(model_dir: Path, tokens: int, seed: int) -> list[tuple[list[int], list[int]]]:
    model, tokenizer = load(str(model_dir))
    shapes = Shapes(ae_output_tokens=tokens)
    single, _ = agent_requests(TextSource(model_dir, seed + 4000), shapes)
    pairs = []
    for messages in single:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=tokens)]
        pairs.append((list(prompt), out))
    return pairs


def replay(prompt: list[int], out: list[int], max_draft: int) -> dict:
    drafts = speculation.Drafts("on", max_draft, ("prompt",), lambda c, n: [],
                                end=10**9, vocab_size=10**9)
    cost = speculation.STEP_COST["gpu"]
    k, verifies, decodes, spent = 1, 0, 0, 0.0
    while k < len(out):
        context = prompt + out[:k]
        draft = drafts.draft(context) if drafts.wants_draft(k) else []
        if not draft:
            decodes += 1
            spent += cost.decode(1)
            k += 1
            continue
        kept = 0
        while kept < len(draft) and k + kept < len(out) and draft[kept] == out[k + kept]:
            kept += 1
        drafts.record(len(draft), kept)
        verifies += 1
        spent += cost.verified(1, len(draft) + 1)
        k += kept + 1
    return {"tokens": len(out), "verifies": verifies, "decodes": decodes,
            "tokens_per_verify": round((len(out) - 1 - decodes) / max(verifies, 1), 2),
            "acceptance": round(drafts.accepted / max(drafts.drafted, 1), 3),
            "speedup": round((len(out) - 1) * cost.decode(1) / spent, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-drafts", default="8,16,32")
    args = parser.parse_args()
    pairs = answers(args.model, args.tokens, args.seed)
    for max_draft in map(int, args.max_drafts.split(",")):
        for i, (prompt, out) in enumerate(pairs):
            print(json.dumps({"answer": i, "max_draft": max_draft,
                              **replay(prompt, out, max_draft)}), flush=True)


if __name__ == "__main__":
    main()
