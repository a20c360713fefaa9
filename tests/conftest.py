"""Shared fixtures: tiny demo models, built once per test session (seconds, offline)."""

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.demo_model import build_demo_model


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama demo model with seed 0: what `radix-mlx serve` uses by default."""
    return build_demo_model(tmp_path_factory.mktemp("demo-model") / "tiny-seed0")


@pytest.fixture(scope="session")
def demo_model_family(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path
) -> Callable[[str], Path]:
    """Returns a builder of the tiny demo model of a family, each built once per session.

    Families: "llama" (KVCache), "gemma3_text" (RotatingKVCache + KVCache),
    "qwen3_next" (ArraysCache + KVCache).
    """
    built = {"llama": demo_model_dir}

    def build(family: str) -> Path:
        if family not in built:
            directory = tmp_path_factory.mktemp(f"demo-{family}") / f"tiny-{family}-seed0"
            built[family] = build_demo_model(directory, family=family)
        return built[family]

    return build
