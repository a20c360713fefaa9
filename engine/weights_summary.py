"""What a model directory's weights are, from their safetensors headers alone: how many
parameters and in which dtype (Ollama's `parameter_size` and `quantization_level`), read
in microseconds without loading a tensor."""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# Safetensors' float dtypes, whose names are Ollama's for a file's type.
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})


@dataclass(frozen=True)
class WeightsSummary:
    parameters: int
    dtype: str  # the weights' main float dtype (F32, F16, BF16), "" where none is


def summarize(directory: Path, bits: int | None = None) -> WeightsSummary | None:
    """The weights of `directory`'s `*.safetensors`; `bits`: an MLX-quantized model's
    width, whose packed uint32 weights hold 32 / bits parameters a value (their scales
    and biases are not parameters). None where the headers cannot be read."""
    tensors: dict[str, tuple[str, int]] = {}
    try:
        for path in sorted(directory.glob("*.safetensors")):
            tensors.update(_header(path))
    except (OSError, ValueError, struct.error):
        return None
    if not tensors:
        return None
    quantized = {name.removesuffix(".scales") for name in tensors if name.endswith(".scales")}
    parameters, dtypes = 0, Counter()
    for name, (dtype, count) in tensors.items():
        layer = name.rsplit(".", 1)[0]
        if layer in quantized and not name.endswith(".weight"):
            continue  # a quantized layer's scales and biases
        if layer in quantized and dtype == "U32" and bits:
            count = count * 32 // bits
        parameters += count
        if dtype in FLOAT_DTYPES:
            dtypes[dtype] += count
    return WeightsSummary(parameters, dtypes.most_common(1)[0][0] if dtypes else "")


def _header(path: Path) -> dict[str, tuple[str, int]]:
    """Each tensor's (dtype, element count) in one safetensors file."""
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    return {name: (entry["dtype"], math.prod(entry["shape"]))
            for name, entry in header.items() if name != "__metadata__"}


def human_number(count: int) -> str:
    """A count as Ollama's format.HumanNumber writes it: 134.52M, 7.6B, 8B, 12K."""
    for unit, size, decimals in (("B", 10**9, 1), ("M", 10**6, 2)):
        if count >= size:
            number = count / size
            return f"{number:.0f}{unit}" if number == int(number) else f"{number:.{decimals}f}{unit}"
    return f"{count / 1000:.0f}K" if count >= 1000 else str(count)
