"""Put first on PYTHONPATH, makes a Python process see radix-mlx as a source checkout that
is not pip-installed, as the GPU machines run it: its distribution metadata is not found."""

import importlib.metadata
import sys

_distribution = importlib.metadata.distribution


def _without_radix_mlx(name: str) -> importlib.metadata.Distribution:
    if name.replace("_", "-").lower() == "radix-mlx":
        raise importlib.metadata.PackageNotFoundError(name)
    return _distribution(name)


importlib.metadata.distribution = _without_radix_mlx

# Python imports one sitecustomize, this one first on the path: it also hides torch, as
# ../without_torch's would (which says why).
sys.modules.setdefault("torch", None)
