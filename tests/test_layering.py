"""The layering the code promises: the server's HTTP side and the engine's public API
import in a Python where MLX is not installed (here: made unimportable), radix/ never
needs it at all, only the server's launch modules reach it, and no two modules import
each other, directly or around a cycle."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("radix", "engine", "server")
MLX = {"mlx", "mlx_lm", "mlx_vlm"}
# The server's modules that start engines, ranks or conversions: the only ones that may
# import MLX (through the engine proper, engine/distributed.py or engine/gguf.py).
LAUNCH_MODULES = {"server.__main__", "server.launch.cli", "server.launch.serve",
                  "server.launch.tensor_parallel", "server.launch.rank_launcher"}

# None in sys.modules is how Python spells "this package is not there": importing it raises
# ModuleNotFoundError, and importlib.util.find_spec reports it missing.
WITHOUT_MLX = """
import sys
sys.modules.update(mlx=None, mlx_lm=None, mlx_vlm=None)
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
    result = imports_without_mlx("server.openai.protocol", "server.openai.routes", "server.app")
    assert result.returncode == 0, result.stderr


def test_the_engine_api_and_the_radix_tree_import_without_mlx():
    result = imports_without_mlx("engine.api", "engine.tokenizer", "engine.tree_hold",
                                 "engine.constraints", "radix")
    assert result.returncode == 0, result.stderr


def test_the_engine_itself_needs_mlx():
    """The check above can fail: the engine proper does import MLX."""
    result = imports_without_mlx("engine.engine")
    assert result.returncode != 0 and "mlx" in result.stderr


WITHOUT_MLX_VLM = """
import sys
sys.modules["mlx_vlm"] = None
import {modules}
"""


def test_a_server_of_text_models_runs_without_the_vision_extra():
    """mlx-vlm is the `vision` extra: the engine and the serve path import without it (a
    GPU checkout without it once could not start any server)."""
    code = WITHOUT_MLX_VLM.format(modules="engine.engine, engine.loader, server.launch.serve")
    result = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module `path` imports when it runs (in functions too, since a lazy import
    still runs), as dotted names and `from` names; not those only a type checker sees."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for node in ast.walk(block)}
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names |= {module, *(f"{module}.{alias.name}" for alias in node.names)}
    return names


@functools.cache
def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Our modules -> the modules of ours they import, and -> the top-level packages of
    everything they import."""
    files = {module_name(path): path for package in PACKAGES
             for path in (ROOT / package).rglob("*.py")}
    names = {module: imported(path) for module, path in files.items()}
    ours = {module: {name for name in found if name in files} for module, found in names.items()}
    tops = {module: {name.split(".")[0] for name in found} for module, found in names.items()}
    return ours, tops


def reaches_mlx() -> set[str]:
    ours, tops = import_graph()
    reaching = {module for module, found in tops.items() if found & MLX}
    while True:
        more = {module for module, deps in ours.items() if deps & reaching} - reaching
        if not more:
            return reaching
        reaching |= more


def test_only_the_launch_modules_of_the_server_import_mlx():
    server = {module for module in reaches_mlx() if module.split(".")[0] == "server"}
    assert server <= LAUNCH_MODULES, f"these server modules import MLX: {server - LAUNCH_MODULES}"
    assert "server.launch.serve" in server, "the check above can fail: serve does reach MLX"


def test_the_import_graph_has_no_cycles():
    ours, _ = import_graph()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(module):])}"
                                 f" -> {module}")
        if module in done:
            return
        for dep in sorted(ours[module]):
            visit(dep, (*path, module))
        done.add(module)

    for module in sorted(ours):
        visit(module, ())
