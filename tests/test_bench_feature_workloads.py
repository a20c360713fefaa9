"""The benchmark harness's workloads of one feature each against radix-mlx servers on the
tiny demo model: speculative decoding, several models and the prefill-only endpoints.
Checks the shape of the results, never a timing; test_bench.py has the standard ones."""

import json
from pathlib import Path

import pytest

pytest.importorskip("psutil")

from bench.__main__ import main
from bench.report import several_models_section, targets
from bench.workloads import QUICK


@pytest.mark.usefixtures("children_without_torch")
def test_speculation_workloads(demo_model_dir: Path, tmp_path: Path) -> None:
    """The agent edit workload with speculation off, on, auto and on with a draft model
    (the demo model itself), their servers running together and taking turns, and bare
    mlx-lm on the same chats; the standard workloads without repetition, off and auto. The
    demo model's output does not copy its prompt: what matters here is that it is the
    same text."""
    main(["--model", str(demo_model_dir), "--servers", "radix-mlx", "--quick", "--no-plots",
          "--no-structured", "--out", str(tmp_path), "--workloads",
          "agent_edit,spec_no_repeat", "--draft-model", str(demo_model_dir)])
    results = json.loads((tmp_path / "results.json").read_text())
    edit = results["speculation"]["agent_edit"]
    assert edit["streams"] == QUICK.ae_streams and edit["rounds"] == QUICK.spec_rounds
    # Each round's batch against off's of the same round; every round's texts compared.
    assert len(edit["on"]["streams_vs_off_rounds"]) == QUICK.spec_rounds
    assert len(edit["off"]["streams_texts"]) == QUICK.spec_rounds * QUICK.ae_streams
    assert edit["draft model"]["acceptance"] > 0.5  # the model guesses its own argmax
    for mode in ("on", "auto", "draft model"):
        assert edit[mode]["same_output"] and edit[mode]["same_streams_output"]
        assert edit[mode]["vs_mlx_lm"] > 0 and edit[mode]["streams_vs_off"] > 0
    assert edit["on"]["acceptance"] is not None
    plain = results["speculation"]["spec_no_repeat"]
    assert set(plain) == {"single_stream", "no_share"}
    assert all(modes["ratio"] > 0 for modes in plain.values())
    assert all(len(modes["off"]["rounds"]) == QUICK.spec_rounds for modes in plain.values())
    assert "--speculation on, a draft model" in (tmp_path / "results.md").read_text()


@pytest.mark.usefixtures("children_without_torch")
def test_several_models_reload_and_report(demo_model_dir: Path, tmp_path: Path) -> None:
    """idle_reload on real servers (one start: its other workloads start six, and the
    server tests cover what they measure); the report of all three from their figures."""
    main(["--model", str(demo_model_dir), "--quick", "--no-raw", "--no-plots",
          "--no-structured", "--out", str(tmp_path), "--workloads", "idle_reload"])
    results = json.loads((tmp_path / "results.json").read_text())
    reload = results["several_models"]["idle_reload"]
    assert reload["cached_fraction"] >= 0.9 and reload["same_output"]
    assert reload["reload_seconds"] > 0 and reload["ttft_after_reload"] > 0
    several = {
        **results["several_models"],
        "model_switching": {"one model": {"requests": 4, "ttft_p50": 1.0},
                            "one model, own process": {"requests": 4, "ttft_p50": 1.0},
                            "two models": {"requests": 4, "ttft_p50": 1.05},
                            "ttft_ratio": 1.05, "ttft_ratio_in_process": 1.05},
        "model_flood": {"models": 3, "budget_fits": 2, "concurrency": 2,
                        "one model": {"requests": 6, "wall_s": 1.0, "errors": 0, "errors_5xx": 0},
                        "one model again": {"requests": 6, "wall_s": 1.0, "errors": 0,
                                            "errors_5xx": 0},
                        "three models": {"requests": 6, "wall_s": 2.0, "errors": 1,
                                         "errors_5xx": 1, "unloads": 2},
                        "identical_answers": 5, "identical_answers_control": 6},
    }
    rows = {row["target"]: row["met"]
            for row in targets({**results, "several_models": several})}
    assert rows["two loaded models asked in turn: TTFT p50 / one model's"] is True
    assert rows["flood over 3 models, budget for 2: failed requests"] is False
    assert rows["flood over 3 models: greedy answers equal to one model's"] is False
    assert rows["after an idle unload and reload: cached share of the prompt"] is True
    text = "\n".join(several_models_section(several))
    assert "1.05x" in text and "5 of 6" in text and "control) matched 6 of 6" in text


def test_prefill_endpoints_workloads(demo_model_dir: Path, tmp_path: Path) -> None:
    """all-MiniLM-L6-v2's embeddings against sentence-transformers, and a rerank on the
    demo model: the query is computed once for all its documents."""
    main(["--model", str(demo_model_dir), "--quick", "--no-raw", "--no-plots",
          "--no-structured", "--out", str(tmp_path), "--workloads", "embeddings,rerank"])
    results = json.loads((tmp_path / "results.json").read_text())
    embeddings = results["prefill_endpoints"]["embeddings"]
    assert embeddings["sentences"] == QUICK.em_sentences and embeddings["min_cosine"] > 0.9999
    assert embeddings["sentences_s"] > 0 and embeddings["reference_sentences_s"] > 0
    rerank = results["prefill_endpoints"]["rerank"]
    assert len(rerank["rounds"]) == QUICK.rr_rounds
    for one in rerank["rounds"]:
        # Every document's prompt holds the judge's instructions and the query: computed
        # once, the rest is each document's own tokens and the few around them.
        assert one["computed_tokens"] < one["prompt_tokens"] / 2
        assert one["computed_tokens"] >= one["document_tokens"]
    rows = {row["target"]: row for row in results["targets"]}
    assert rows["rerank, causal judge: prompt tokens computed / the documents' own"][
        "value"] == rerank["computed_per_document_token"]
    assert "embeddings sentences/s vs sentence-transformers (all-MiniLM-L6-v2)" in rows
    text = (tmp_path / "results.md").read_text()
    assert "## Prefill-only endpoints" in text and "sentence-transformers" in text
