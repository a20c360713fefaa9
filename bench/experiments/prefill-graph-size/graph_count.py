"""The primitives MLX would run to evaluate some arrays, by kind: what `mx.export_to_dot`
writes of their graph (arrays already evaluated are its leaves, not counted)."""

import collections
import os
import re
import tempfile

import mlx.core as mx

_LABEL = re.compile(r'label ="([^"]+)", shape=rectangle')


def arrays_in(tree) -> list:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [a for item in tree for a in arrays_in(item)]
    return []


def primitives(tree) -> collections.Counter:
    with tempfile.NamedTemporaryFile("w", suffix=".dot", delete=False) as file:
        path = file.name
    try:
        mx.export_to_dot(path, *arrays_in(tree))
        with open(path) as dot:
            return collections.Counter(_LABEL.findall(dot.read()))
    finally:
        os.unlink(path)


def line(name: str, kinds: collections.Counter) -> str:
    top = " ".join(f"{kind}={n}" for kind, n in kinds.most_common(12))
    return f"{name}: {sum(kinds.values())} primitives: {top}"
