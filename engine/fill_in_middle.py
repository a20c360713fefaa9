"""Fill in the middle: a code model writes what goes between the text before a gap
(prefix) and the text after it (suffix), as editors' autocomplete asks at the cursor.

Code models learn it with control tokens in their vocabulary, in prefix-suffix-middle
order: `<PRE> prefix <SUF> suffix <MID>`, and the model writes the middle. The tokens are
found by their text, as llama.cpp's vocabulary does it, since no tokenizer config names
them. Repository-level context (Qwen2.5-Coder's, arXiv 2409.12186) goes before the
prefix: `<REPO> name` and one `<FILE_SEP> filename` + text per other file of the
project, then a `<FILE_SEP>` line for the file being edited (llama.cpp's /infill builds
the same prompt from its `input_extra`).

Codestral learned the other order, suffix first, with no middle token: `[SUFFIX] suffix
[PREFIX] prefix`, and the middle follows the prefix (mistral-common's `encode_fim`,
Ollama's codestral template). Typing at the cursor only lengthens the prompt's end there,
so the prefix cache keeps the whole prompt before the cursor from one keystroke to the next.
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
# Codestral's (prefix, suffix) tokens, in the suffix-first order.
SUFFIX_FIRST = ("[PREFIX]", "[SUFFIX]")
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
    """A model's fill-in-the-middle token ids (`middle` None: the suffix-first order)."""

    prefix: int
    suffix: int
    middle: int | None
    repository: int | None = None
    file_separator: int | None = None
    pad: int | None = None
    end: int | None = None
    names: tuple[str, ...] = ()  # the prefix, suffix and middle tokens' text

    @property
    def suffix_first(self) -> bool:
        return self.middle is None

    @property
    def ends(self) -> tuple[int, ...]:
        """Tokens that end a middle besides the model's EOS: its own end of a middle, or,
        for a model that goes on past its middle, the next file of the repository, a pad,
        or (suffix first, where nothing follows the middle) another gap's tokens."""
        gap = (self.prefix, self.suffix) if self.suffix_first else ()
        return tuple(token for token in (self.end, self.repository, self.file_separator,
                                         self.pad, *gap) if token is not None)


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
    prefix, suffix = (token_id(name) for name in SUFFIX_FIRST)
    if prefix is not None and suffix is not None:
        return FillInMiddleTokens(prefix, suffix, None, names=SUFFIX_FIRST)
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
    one (`INFILL_BATCH`). Suffix first, the suffix is encoded as text that goes on from
    before it (no word-start space a SentencePiece tokenizer puts before a text), as
    mistral-common encodes it."""
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
    before = encode(prefix)
    after = _continuing(encode, suffix) if tokens.suffix_first else encode(suffix)
    if fit is not None:
        before, after = before[len(before) - min(len(before), PREFIX_TOKENS):], after[:SUFFIX_TOKENS]
        controls = 2 if tokens.suffix_first else 3
        room = max(0, fit - len(head) - len(before) - len(after) - controls)
        context = context[len(context) - min(len(context), room):]
    if tokens.suffix_first:
        return [*head, *context, tokens.suffix, *after, tokens.prefix, *before]
    return [*head, *context, tokens.prefix, *before, tokens.suffix, *after, tokens.middle]


def _continuing(encode: Callable[[str], list[int]], text: str) -> list[int]:
    """`text`'s tokens as the continuation of other text: encoded after a newline, whose
    tokens are then dropped (a SentencePiece tokenizer's word-start space goes with them);
    as it is encoded alone where the newline's tokens do not come out the same."""
    anchor = encode("\n")
    tokens = encode("\n" + text)
    return tokens[len(anchor):] if tokens[:len(anchor)] == anchor else encode(text)
