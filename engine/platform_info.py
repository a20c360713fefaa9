"""Which device and BLAS MLX runs on, and where a fast BLAS is on Linux.

MLX's Linux CPU wheel bundles a reference BLAS that ran float32 GEMM ~40x slower than
Debian's OpenBLAS on our machines, so the CLI preloads OpenBLAS when MLX would run on the
CPU, and the server logs what it actually got. Only `describe_platform` imports MLX: the
preload decision has to be made before MLX is loaded.
"""

import importlib.metadata
import os
import platform
import sys
from pathlib import Path

OPT_OUT_ENV = "RADIX_MLX_NO_OPENBLAS"
CUDA_DISTRIBUTIONS = ("mlx-cuda-13", "mlx-cuda-12")
CUDNN_ATTENTION_ENV = "MLX_CUDA_USE_CUDNN_SDPA"
# MLX's CUDA backend computes prompt attention with cuDNN, building an execution plan for
# every new shape (query length, key length, cache buffer) it meets: 60-90 ms each on an
# H100, and a server rarely sees the same prompt shape twice. 32 distinct 1000-token
# prompts took 7.0 s with cuDNN and 2.9 s with MLX's own attention, which has no such cost.
MLX_ENV_DEFAULTS = {CUDNN_ATTENTION_ENV: "0"}


def openblas_library() -> Path | None:
    """Debian/Ubuntu's pthread OpenBLAS (package libopenblas0-pthread), if installed."""
    machine = platform.machine()
    candidate = Path(f"/usr/lib/{machine}-linux-gnu/openblas-pthread/libblas.so.3")
    return candidate if candidate.is_file() else None


def mlx_would_use_cpu() -> bool:
    """Guess, without importing MLX, whether it will compute on the CPU."""
    if sys.platform == "darwin":
        return False
    return not (_installed_libmlx_is_cuda() and Path("/dev/nvidiactl").exists())


def openblas_preload_env() -> dict[str, str] | None:
    """The environment to re-exec with so OpenBLAS is preloaded, or None if not needed."""
    if sys.platform != "linux" or os.environ.get(OPT_OUT_ENV) == "1":
        return None
    preloaded = os.environ.get("LD_PRELOAD", "")
    library = openblas_library()
    if "openblas" in preloaded or library is None or not mlx_would_use_cpu():
        return None
    return {**os.environ, "LD_PRELOAD": " ".join(filter(None, [str(library), preloaded]))}


def apply_mlx_env_defaults() -> None:
    """Our defaults for MLX's environment options, where the operator has set none. MLX
    reads them at first use, so this must run before the first forward pass."""
    for name, value in MLX_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


def describe_platform() -> str:
    """One line for the startup log: MLX version, device, and on the CPU the BLAS in use."""
    import mlx.core as mx

    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return f"mlx {mx.__version__}, device gpu (Metal)"
        # What the engine will run with: it applies our defaults before its first forward.
        setting = os.environ.get(CUDNN_ATTENTION_ENV, MLX_ENV_DEFAULTS[CUDNN_ATTENTION_ENV])
        cudnn = "off" if setting == "0" else "on"
        return f"mlx {mx.__version__}, device gpu (CUDA), cuDNN attention {cudnn}"
    return f"mlx {mx.__version__}, device cpu, BLAS: {_blas_in_use()}"


def _blas_in_use() -> str:
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()}
    except OSError:
        return "unknown"
    # numpy's scipy_openblas has prefixed symbols, so MLX never calls into it.
    openblas = sorted(p for p in mapped if "openblas" in p and "scipy_openblas" not in p)
    if openblas:
        return f"OpenBLAS ({openblas[0]})"
    return "MLX's bundled reference BLAS (slow: install libopenblas0-pthread, start via radix-mlx)"


def _installed_libmlx_is_cuda() -> bool:
    # mlx-cpu and mlx-cuda-* both ship mlx/lib/libmlx.so and the last one installed wins,
    # so ask which distribution's recorded size the file on disk has.
    for name in CUDA_DISTRIBUTIONS:
        try:
            files = importlib.metadata.distribution(name).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for file in files:
            if str(file) == "mlx/lib/libmlx.so":
                located = Path(file.locate())
                if located.is_file() and located.stat().st_size == file.size:
                    return True
    return False
