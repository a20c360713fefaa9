"""The demo Gemma 3 vision model's real shape, `4b`: checked on its config and on MLX's
lazy parameters, never computed (4.3B of them, what a GPU builds)."""

from __future__ import annotations

import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3
from mlx_lm.models.cache import RotatingKVCache

from engine.demo_vlm import (
    LM_HEAD,
    REAL_TOKENIZER_VOCAB,
    SPECIAL_TOKENS,
    build_demo_vlm,
    gemma3_model,
    model_config,
)


def test_the_4b_size_has_gemma_3_4bs_parameters_and_layers():
    config = model_config("4b", REAL_TOKENIZER_VOCAB,
                          {token: index for index, token in enumerate(SPECIAL_TOKENS)})
    model = gemma3_model(config)
    sizes = {name: value.size for name, value in tree_flatten(model.parameters())}
    # The engine runs mlx-lm's language model of the folder.
    caches = gemma3.Model(gemma3.ModelArgs.from_dict(config)).make_cache()

    # google/gemma-3-4b-it's safetensors hold 8,600,158,944 bytes of bfloat16; its output
    # head is its embeddings (the builder drops the module's own).
    assert sum(sizes.values()) - sizes[LM_HEAD] == 4_300_079_472
    assert config["vocab_size"] == config["text_config"]["vocab_size"] == 262208
    assert config["torch_dtype"] == "bfloat16"
    assert [index for index, cache in enumerate(caches)
            if not isinstance(cache, RotatingKVCache)] == [5, 11, 17, 23, 29]
    assert {cache.max_size for cache in caches if isinstance(cache, RotatingKVCache)} == {1024}


@pytest.mark.parametrize("option", [{"family": "qwen2_5_vl"}, {"sliding_window": 64}])
def test_the_4b_size_is_gemma_3s_own_shape(tmp_path, option):
    with pytest.raises(ValueError):
        build_demo_vlm(tmp_path / "model", size="4b", **option)
