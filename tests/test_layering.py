"""The layering the code promises: the server's HTTP side and the engine's public API
import in a Python where MLX is not installed (here: made unimportable), and radix/ never
needs it at all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# None in sys.modules is how Python spells "this package is not there": importing it raises
# ModuleNotFoundError, and importlib.util.find_spec reports it missing.
WITHOUT_MLX = """
import sys
sys.modules.update(mlx=None, mlx_lm=None)
try:
    import mlx.core
except ImportError:
    pass
else:
    raise SystemExit("mlx is still importable")
import {modules}
"""


def imports_without_mlx(*modules: str) -> subprocess.CompletedProcess:
    code = WITHOUT_MLX.format(modules=", ".join(modules))
    return subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_servers_protocol_and_routes_import_without_mlx():
    result = imports_without_mlx("server.protocol", "server.routes", "server.app")
    assert result.returncode == 0, result.stderr


def test_the_engine_api_and_the_radix_tree_import_without_mlx():
    result = imports_without_mlx("engine.api", "engine.tokenizer", "engine.tree_hold",
                                 "engine.constraints", "radix")
    assert result.returncode == 0, result.stderr


def test_the_engine_itself_needs_mlx():
    """The check above can fail: the engine proper does import MLX."""
    result = imports_without_mlx("engine.engine")
    assert result.returncode != 0 and "mlx" in result.stderr
