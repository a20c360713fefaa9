"""Put first on PYTHONPATH, makes a Python process see radix-mlx as a source checkout that
is not pip-installed, as the GPU machines run it: its distribution metadata is not found."""

import importlib.metadata

_distribution = importlib.metadata.distribution


def _without_radix_mlx(name: str) -> importlib.metadata.Distribution:
    if name.replace("_", "-").lower() == "radix-mlx":
        raise importlib.metadata.PackageNotFoundError(name)
    return _distribution(name)


importlib.metadata.distribution = _without_radix_mlx
