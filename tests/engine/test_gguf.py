"""GGUF files become mlx-lm model directories that compute what the original model does.

The files are the tiny demo model written as llama.cpp writes GGUFs (Q/K rows permuted for
interleaved RoPE, a byte-level BPE as tokens + merges), in the types MLX reads itself and
in types only the gguf package dequantizes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from mlx_lm.utils import load_tokenizer

from engine.chat_templates import known_template
from engine.gguf import GGUFError, cached_model_dir, convert, read_gguf
from tests.engine.gguf_files import (
    UNSERVABLE,
    demo_variant,
    unservable_gguf,
    write_demo_gguf,
)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog in 2024.",
    "café naïve Straße — 你好，世界 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def greedy_tokens(model_dir: Path, prompt: str, max_tokens: int = 12) -> list[int]:
    model, tokenizer = mlx_lm.load(str(model_dir))
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids,
                                                    max_tokens=max_tokens)]


def test_a_llama_gguf_computes_what_the_model_it_came_from_does(demo_model_dir, tmp_path):
    write_demo_gguf(demo_model_dir, tmp_path / "demo.gguf")
    converted = convert(tmp_path / "demo.gguf", tmp_path / "converted", "float32")
    original_tokenizer = load_tokenizer(demo_model_dir)
    tokenizer = load_tokenizer(converted)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == original_tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_ids == original_tokenizer.eos_token_ids
    messages = [{"role": "user", "content": "Tell me about the lighthouse."}]
    assert (tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            == original_tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert (greedy_tokens(converted, "The lighthouse keeper")
            == greedy_tokens(demo_model_dir, "The lighthouse keeper"))


def test_a_gguf_without_a_chat_template_gets_its_familys(demo_model_dir, tmp_path):
    """As llama.cpp falls back to a known template: the demo vocabulary has ChatML's
    markers, so its chat renders as ChatML."""
    write_demo_gguf(demo_model_dir, tmp_path / "bare.gguf", chat_template=False)
    converted = convert(tmp_path / "bare.gguf", tmp_path / "converted", "float32")
    tokenizer = load_tokenizer(converted)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) \
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
        "<|im_start|>assistant\n"
    eos = json.loads((converted / "config.json").read_text())["eos_token_id"]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in eos


@pytest.mark.parametrize(("vocabulary", "family"), [
    (["<bos>", "<start_of_turn>", "<end_of_turn>"], "gemma3"),
    (["<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>"], "llama3"),
    (["<s>", "</s>"], "chatml"),
])
def test_the_fallback_family_is_told_by_its_turn_markers(vocabulary, family):
    assert known_template(vocabulary).name == family


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_ggufs_compute_what_their_models_do(family, demo_model_dir, tmp_path):
    """No Q/K permutation here (llama.cpp runs Qwen with NeoX RoPE), plus each family's
    own tensors: qwen2's q/k/v biases, qwen3's q/k norms."""
    model_dir = demo_variant(demo_model_dir, tmp_path / family, family)
    write_demo_gguf(model_dir, tmp_path / f"{family}.gguf", architecture=family)
    converted = convert(tmp_path / f"{family}.gguf", tmp_path / "converted", "float32")
    assert json.loads((converted / "config.json").read_text())["model_type"] == family
    assert (greedy_tokens(converted, "The lighthouse keeper")
            == greedy_tokens(model_dir, "The lighthouse keeper"))


def test_types_mlx_cannot_read_are_dequantized_with_the_gguf_package(demo_model_dir, tmp_path):
    stored = write_demo_gguf(demo_model_dir, tmp_path / "q5.gguf", Q.Q5_0, Q.BF16)
    converted = convert(tmp_path / "q5.gguf", tmp_path / "float32", "float32")
    weights = mx.load(str(converted / "model.safetensors"))
    assert weights.keys() == stored.keys()
    for name, value in stored.items():
        assert weights[name].dtype == mx.float32
        np.testing.assert_array_equal(np.array(weights[name]), value, err_msg=name)


def test_native_requantizes_what_mlx_cannot_read_at_its_own_width(demo_model_dir, tmp_path):
    write_demo_gguf(demo_model_dir, tmp_path / "q5.gguf", Q.Q5_0, Q.BF16)
    native = convert(tmp_path / "q5.gguf", tmp_path / "native", "native")
    config = json.loads((native / "config.json").read_text())
    assert config["quantization"] == {"bits": 5, "group_size": 32, "mode": "affine"}
    weights = mx.load(str(native / "model.safetensors"))
    assert weights["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    assert weights["model.embed_tokens.weight"].dtype == mx.bfloat16
    assert len(greedy_tokens(native, "The sea", max_tokens=4)) == 4


def test_native_keeps_the_quantization_mlx_reads(demo_model_dir, tmp_path):
    """Q4_1 matrices stay 4-bit and a Q8_0 embedding 8-bit, exactly as stored."""
    stored = write_demo_gguf(demo_model_dir, tmp_path / "q4.gguf", Q.Q4_1, Q.Q8_0)
    native = convert(tmp_path / "q4.gguf", tmp_path / "native", "native")
    config = json.loads((native / "config.json").read_text())
    assert config["quantization"] == {
        "bits": 4, "group_size": 32, "mode": "affine",
        "model.embed_tokens": {"bits": 8, "group_size": 32},
    }
    weights = mx.load(str(native / "model.safetensors"))
    for stem, bits in (("model.embed_tokens", 8), ("model.layers.1.self_attn.q_proj", 4)):
        parts = [weights[f"{stem}.{part}"].astype(mx.float32) if part != "weight"
                 else weights[f"{stem}.weight"] for part in ("weight", "scales", "biases")]
        value = mx.dequantize(*parts, group_size=32, bits=bits)
        np.testing.assert_array_equal(np.array(value), stored[f"{stem}.weight"])
    assert len(greedy_tokens(native, "The sea", max_tokens=4)) == 4


def test_the_conversion_is_cached_per_file_identity_and_dtype(
    demo_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "demo.gguf"
    write_demo_gguf(demo_model_dir, path)
    first = cached_model_dir(path, "float32")
    assert first.name == "demo" and (first / "config.json").is_file()
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_model_dir(path, "float32") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written
    assert cached_model_dir(path, "float16") != first
    os.utime(path, ns=(written + 10**9, written + 10**9))  # the file changed
    assert cached_model_dir(path, "float32") != first
    assert not list((tmp_path / "cache").rglob(".demo.*"))  # no staging left behind


@pytest.mark.parametrize("case", UNSERVABLE)
def test_a_file_that_cannot_be_served_is_refused_with_its_cause(case, demo_model_dir, tmp_path):
    path, cause = unservable_gguf(case, demo_model_dir, tmp_path)
    with pytest.raises(GGUFError, match=cause) as raised:
        read_gguf(path)
    assert "\n" not in str(raised.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(GGUFError, match=f"cannot read {tmp_path / 'absent.gguf'}"):
        read_gguf(tmp_path / "absent.gguf")
