"""What a model's config.json says about its embeddings' sizes."""

from __future__ import annotations

from engine.embedding_config import hidden_size, matryoshka_dimensions


def test_declared_matryoshka_sizes_past_the_width_are_not_offered():
    assert matryoshka_dimensions({"matryoshka_dimensions": [1024, 256, 64]}, 256) == (256, 64)


def test_is_matryoshka_offers_every_size_up_to_the_width_as_a_range():
    assert matryoshka_dimensions({"is_matryoshka": True}, 4096) == range(1, 4097)
    assert matryoshka_dimensions({}, 4096) is None


def test_the_hidden_size_is_the_models_or_its_text_models():
    assert hidden_size({"hidden_size": 576}) == 576
    assert hidden_size({"text_config": {"hidden_size": 2560}}) == 2560
    assert hidden_size({"n_embd": 768}) is None
