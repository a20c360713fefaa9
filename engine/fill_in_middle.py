"""Fill in the middle: a code model writes what goes between the text before a gap
(prefix) and the text after it (suffix), as editors' autocomplete asks at the cursor.

Code models learn it with control tokens in their vocabulary, in prefix-suffix-middle
order: `<PRE> prefix <SUF> suffix <MID>`, and the model writes the middle. The tokens are
found by their text, as llama.cpp's vocabulary does it, since no tokenizer config names
them. Repository-level context (Qwen2.5-Coder's, arXiv 2409.12186) goes before the
prefix: `<REPO> name` and one `<FILE_SEP> filename` + text per other file of the
project, then a `<FILE_SEP>` line for the file being edited (llama.cpp's /infill builds
the same prompt from its `input_extra`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Each family's (prefix, suffix, middle) tokens.
MARKERS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder 1 and 2, Granite Code
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),  # Replit
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # CodeLlama
    ("<PRE>", "<SUF>", "<MID>"),
    ("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>"),  # CodeGeeX4
)
REPOSITORY = ("<|repo_name|>", "<repo_name>", "<|fim_repo|>", "<reponame>", "<fim-repo>")
FILE_SEPARATOR = ("<|file_sep|>", "<file_sep>", "<fim-sep>")
PAD = ("<|fim_pad|>", "<fim_pad>", "<fim-pad>")
# CodeLlama ends a middle with its own token, not with its EOS.
END_OF_MIDDLE = ("▁<EOT>", "<EOT>")
# What llama.cpp names the project and the edited file: the model only sees that there is one.
PROJECT_NAME = "myproject"
EDITED_FILE_NAME = "filename"
# llama.cpp's /infill fits its prompt into a batch of 2,048 tokens and the project's files
# into the rest of the context: at most the prefix's last three quarters of the batch,
# the suffix's first quarter (less the three control tokens), then the files' last tokens
# that fit. Editor plugins send a ring of recently seen code that may outgrow any window.
INFILL_BATCH = 2048
PREFIX_TOKENS = 3 * INFILL_BATCH // 4
SUFFIX_TOKENS = INFILL_BATCH // 4 - 3


@dataclass(frozen=True)
class FillInMiddleTokens:
    """A model's fill-in-the-middle token ids."""

    prefix: int
    suffix: int
    middle: int
    repository: int | None = None
    file_separator: int | None = None
    pad: int | None = None
    end: int | None = None
    names: tuple[str, ...] = ()  # the prefix, suffix and middle tokens' text

    @property
    def ends(self) -> tuple[int, ...]:
        """Tokens that end a middle besides the model's EOS: its own end of a middle, or,
        for a model that goes on past its middle, the next file of the repository or a
        pad."""
        return tuple(token for token in (self.end, self.repository, self.file_separator,
                                         self.pad) if token is not None)


def find_tokens(token_id: Callable[[str], int | None]) -> FillInMiddleTokens | None:
    """The model's fill-in-the-middle tokens, `token_id` giving a token's id by its text
    (None: not in the vocabulary), or None when the vocabulary has no family's complete
    set (the model was not trained to fill in the middle)."""
    for names in MARKERS:
        ids = [token_id(name) for name in names]
        if None not in ids:
            prefix, suffix, middle = ids
            return FillInMiddleTokens(prefix, suffix, middle, _first(token_id, REPOSITORY),
                                      _first(token_id, FILE_SEPARATOR), _first(token_id, PAD),
                                      _first(token_id, END_OF_MIDDLE), names)
    return None


def _first(token_id: Callable[[str], int | None], names: Sequence[str]) -> int | None:
    return next((found for name in names if (found := token_id(name)) is not None), None)


def infill_prompt(tokens: FillInMiddleTokens, encode: Callable[[str], list[int]],
                  prefix: str, suffix: str, files: Sequence[tuple[str, str]] = (),
                  head: Sequence[int] = (), fit: int | None = None) -> list[int]:
    """The prompt for the middle between `prefix` and `suffix`, after the other files
    (`files`: name and text), as a repository where the model knows them; `encode`
    tokenizes text without special tokens, and `head` is what the tokenizer puts before
    a prompt (BOS). A model without a file separator gets the files' texts as they are,
    each after a blank line (llama.cpp separates them with a `--- snippet ---` line).
    With `fit`, a number of tokens, the prompt is cut to it as llama.cpp's /infill cuts
    one (`INFILL_BATCH`)."""
    context: list[int] = []
    if files and tokens.repository is not None and tokens.file_separator is not None:
        context += [tokens.repository, *encode(PROJECT_NAME + "\n")]
    for name, text in files:
        if tokens.file_separator is not None:
            context += [tokens.file_separator, *encode(name + "\n")]
        else:
            context += encode("\n\n")
        context += encode(text)
    if files and tokens.file_separator is not None:
        context += [tokens.file_separator, *encode(EDITED_FILE_NAME + "\n")]
    before, after = encode(prefix), encode(suffix)
    if fit is not None:
        before, after = before[len(before) - min(len(before), PREFIX_TOKENS):], after[:SUFFIX_TOKENS]
        room = max(0, fit - len(head) - len(before) - len(after) - 3)
        context = context[len(context) - min(len(context), room):]
    return [*head, *context, tokens.prefix, *before, tokens.suffix, *after, tokens.middle]
