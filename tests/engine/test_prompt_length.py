"""A prompt's length in characters bounds its tokens from below (`ModelTokenizer.
check_length`), so a text far past the context window is refused without being encoded.
The bound must never refuse a text that fits: checked here against the real encoding, on
texts built from the tokenizer's longest tokens, where the bound is tightest."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_wrapper

from engine.model_source import default_model_file
from engine.tokenizer import ModelTokenizer, TooManyTokens
from tests.engine.gguf_files import write_gguf_tokenizer


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_gguf_tokenizer(default_model_file(), tmp_path_factory.mktemp("smollm2")))


def with_tokenizer_json(directory: Path, target: Path, **changes: object) -> ModelTokenizer:
    """The tokenizer of `directory` with top-level fields of its tokenizer.json changed."""
    shutil.copytree(directory, target)
    state = json.loads((target / "tokenizer.json").read_text())
    (target / "tokenizer.json").write_text(json.dumps({**state, **changes}))
    return ModelTokenizer(load_wrapper(target))


def texts(tokenizer: ModelTokenizer, seed: int) -> list[str]:
    """Runs of the tokenizer's longest pieces (the bound's worst case), random words,
    emoji, CJK, decomposed accents and Hangul jamo, which NFC composes three to one."""
    rng = random.Random(seed)
    vocabulary = sorted(tokenizer.vocabulary(), key=len, reverse=True)[:50]
    longest = [tokenizer.decode([tokenizer.vocabulary()[piece]]) for piece in vocabulary]
    alphabet = ["word", " ", "\n", "😀", "日本語", "e\u0301", "\u1100\u1161\u11a8", "<|im_end|>"]
    return ["".join(rng.choice(longest) for _ in range(200)),
            "".join(rng.choice(alphabet) for _ in range(3000)),
            "e\u0301" * 5000, "\u1100\u1161\u11a8" * 3000, "#" * 20_000, " " * 20_000]


def test_no_text_is_bounded_past_its_real_tokens(smollm2_dir: Path, tmp_path: Path) -> None:
    plain = ModelTokenizer(load_wrapper(smollm2_dir))
    nfc = with_tokenizer_json(smollm2_dir, tmp_path / "nfc", normalizer={"type": "NFC"})
    assert plain.most_chars_a_token and nfc.most_chars_a_token == 3 * plain.most_chars_a_token
    for tokenizer in (plain, nfc):
        for seed in range(3):
            for text in texts(tokenizer, seed):
                tokenizer.check_length(text, len(tokenizer.encode(text, special_tokens=False)))


def test_a_text_far_past_the_bound_is_refused_with_its_least_tokens(smollm2_dir: Path) -> None:
    tokenizer = ModelTokenizer(load_wrapper(smollm2_dir))
    text = "x" * (tokenizer.most_chars_a_token * 8192 + 1)
    with pytest.raises(TooManyTokens) as refused:
        tokenizer.check_length(text, 8191)
    assert refused.value.least == 8192
    tokenizer.check_length(text, None)  # no bound asked: nothing refused


def test_a_tokenizer_that_may_drop_characters_bounds_nothing(smollm2_dir: Path,
                                                             tmp_path: Path) -> None:
    """A normalizer or pre-tokenizer that removes text (here a Split that drops spaces)
    could make a long text few tokens: no bound is claimed for it."""
    dropping = with_tokenizer_json(smollm2_dir, tmp_path / "dropping", pre_tokenizer={
        "type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False})
    assert dropping.most_chars_a_token is None
    dropping.check_length(" " * 1_000_000, 10)
