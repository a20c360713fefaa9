"""Which device and BLAS MLX runs on, and the environment MLX on a Linux CPU needs.

Three things, each read only when a process starts, so the CLI re-executes itself with
them when MLX would run on the CPU (`cpu_env`), and the server logs what it got. Only
`describe_platform` imports MLX: the decision has to be made before MLX is loaded.
- MLX's Linux CPU wheel bundles a reference BLAS that ran float32 GEMM ~40x slower than
  Debian's OpenBLAS on our machines: preload OpenBLAS.
- OpenBLAS picks its kernels by the CPU it detects, and Debian's 0.3.21 does not know every
  CPU a cloud VM reports: on our 2-core Intel Xeon it fell back to its SSE3 "Prescott"
  kernels, 62 GFLOP/s at float32 GEMM, where its AVX-512 "SkylakeX" kernels ran 294. Name
  the kernels the CPU's flags allow (OPENBLAS_CORETYPE).
- glibc serves allocations over its adaptive threshold with fresh mmaps and returns freed
  heap tops to the system, so MLX's buffers of a few MB page-faulted anew on every forward:
  6,700 faults, 10 ms of a 24 ms matmul and GELU. Keep buffers up to 32 MB on the heap and
  the heap's top in the process (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_).
Anything the operator set stays as set.
"""

import ctypes
import importlib.metadata
import os
import platform
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

OPT_OUT_ENV = "RADIX_MLX_NO_OPENBLAS"
OPENBLAS_CORE_ENV = "OPENBLAS_CORETYPE"
# The best OpenBLAS x86-64 kernels a CPU's /proc/cpuinfo flags allow, best first.
OPENBLAS_CORES_BY_FLAGS = (
    ("SkylakeX", {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
    ("Haswell", {"avx2", "fma"}),
)
# glibc's limits (bytes) for MLX on the CPU; the mmap threshold's is glibc's own maximum.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
              "MALLOC_TRIM_THRESHOLD_": str(1024 * 2**20)}
CUDA_DISTRIBUTIONS = ("mlx-cuda-13", "mlx-cuda-12")
CUDNN_ATTENTION_ENV = "MLX_CUDA_USE_CUDNN_SDPA"
# MLX's CUDA backend computes prompt attention with cuDNN, building an execution plan for
# every new shape (query length, key length, cache buffer) it meets: 60-90 ms each on an
# H100, and a server rarely sees the same prompt shape twice. 32 distinct 1000-token
# prompts took 7.0 s with cuDNN and 2.9 s with MLX's own attention, which has no such cost.
CUDA_GRAPHS_ENV = "MLX_USE_CUDA_GRAPHS"
# MLX's CUDA backend records each step's kernels into CUDA graphs, updating a cached
# executable one of the same topology. Recording costs a prompt step's host more than
# launching its kernels, a length met before or not: on an H200 an 8B step computing one
# turn over its cached chat took 90-95 ms with graphs and 62-68 ms launched plainly, and
# multi-turn TTFT p50 fell from 0.24-0.26 s to 0.21 s (bench/experiments/cuda-graphs-prefill).
# A decode step saves 0.5-0.9 ms with them, within the host's spread through the server
# (bench/experiments/cuda-graphs-turns). On an H100's 1B shape, every chat workload but a
# single stream ran 15-40% slower with them, and the single stream no faster
# (bench/experiments/cuda-graphs-workloads).
TF32_ENV = "MLX_ENABLE_TF32"
# MLX's CUDA backend multiplies float32 matrices in TF32 (a 10-bit mantissa) unless told
# not to. Where a model runs in float32 (our demo models; any an operator converts so),
# the same tokens' keys then came out of a batched forward and a forward of their own
# ~1e-3 apart (H200: 1.23005 against 1.22844), and 42 of the engine tests' comparisons
# with mlx-lm's forwards failed where float32 on the CPU passes them; with it off, none
# for that reason. Float32 is asked for to be float32, as PyTorch's matmuls default to;
# bfloat16 and float16 models are not affected.
MLX_ENV_DEFAULTS = {CUDNN_ATTENTION_ENV: "0", CUDA_GRAPHS_ENV: "0", TF32_ENV: "0"}


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


def openblas_core_type(cpuinfo: str | None = None) -> str | None:
    """The OpenBLAS kernels (an OPENBLAS_CORETYPE value) this x86-64 CPU can run, from
    the flags in `cpuinfo` (default: /proc/cpuinfo); None where none of ours applies."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                  if line.startswith("flags")), [])
    return next((core for core, needed in OPENBLAS_CORES_BY_FLAGS if needed <= set(flags)),
                None)


def cpu_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to add to `environ` (default: this process's) so that a process
    started with them runs MLX on the CPU at speed: OpenBLAS preloaded at the kernels the
    CPU allows, glibc's allocator tuned. Empty where nothing is missing or MLX has a GPU;
    no OpenBLAS where the operator opted out."""
    environ = os.environ if environ is None else environ
    if sys.platform != "linux" or not mlx_would_use_cpu():
        return {}
    added = {name: value for name, value in MALLOC_ENV.items() if name not in environ}
    library = openblas_library()
    if library is None or environ.get(OPT_OUT_ENV) == "1":
        return added
    preloaded = environ.get("LD_PRELOAD", "")
    if "openblas" not in preloaded:
        added["LD_PRELOAD"] = ":".join(filter(None, [str(library), preloaded]))
    core = openblas_core_type()
    if core is not None and OPENBLAS_CORE_ENV not in environ:
        added[OPENBLAS_CORE_ENV] = core
    return added


def cpu_reexec_env() -> dict[str, str] | None:
    """This process's environment with `cpu_env` added, to re-execute with; None if
    nothing is missing."""
    added = cpu_env()
    return {**os.environ, **added} if added else None


def apply_mlx_env_defaults() -> None:
    """Our defaults for MLX's environment options, where the operator has set none. MLX
    reads them at first use, so this must run before the first forward pass."""
    for name, value in MLX_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


@contextmanager
def cpu_blas_threads(threads: int) -> Iterator[None]:
    """Within, MLX's CPU matrix products (the preloaded OpenBLAS) use `threads` threads,
    in the whole process; after, as many as before. Nothing changes where MLX does not
    run on an OpenBLAS we can reach."""
    library = ctypes.CDLL(None) if sys.platform == "linux" else None
    if library is None or not hasattr(library, "openblas_set_num_threads"):
        yield
        return
    before = library.openblas_get_num_threads()
    library.openblas_set_num_threads(threads)
    try:
        yield
    finally:
        library.openblas_set_num_threads(before)


def describe_platform() -> str:
    """One line for the startup log: MLX version, device, and on the CPU the BLAS in use."""
    import mlx.core as mx

    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return f"mlx {mx.__version__}, device gpu (Metal)"
        cudnn, graphs, tf32 = ("off" if _mlx_setting(name) == "0" else "on"
                               for name in (CUDNN_ATTENTION_ENV, CUDA_GRAPHS_ENV, TF32_ENV))
        return (f"mlx {mx.__version__}, device gpu (CUDA), cuDNN attention {cudnn}, "
                f"CUDA graphs {graphs}, TF32 {tf32}")
    return f"mlx {mx.__version__}, device cpu, BLAS: {_blas_in_use()}"


def numeric_environment() -> str:
    """What, beside the code and the weights, decides the bits a forward computes: the
    device (its model: other kernels), on the CPU the BLAS and the kernels it picked, on
    CUDA whether float32 products run in TF32 and attention in cuDNN. KV one computed is
    not another's to reuse (`model_fingerprint`). CUDA graphs launch the same kernels, so
    they are left out."""
    import mlx.core as mx

    info = mx.device_info()
    device = (str(mx.default_device()), info.get("architecture"), info.get("device_name"))
    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return repr(device)
        return repr((*device, *(f"{name}={_mlx_setting(name)}"
                                for name in (TF32_ENV, CUDNN_ATTENTION_ENV))))
    return repr((*device, *_blas()))


def _mlx_setting(name: str) -> str:
    """The value MLX runs with of one of `MLX_ENV_DEFAULTS`: the operator's, else ours (the
    engine applies them before its first forward)."""
    return os.environ.get(name, MLX_ENV_DEFAULTS[name])


def _blas_in_use() -> str:
    blas = _blas()
    if blas[0] == "OpenBLAS":
        return f"OpenBLAS ({blas[1]}, {blas[2]} kernels)"
    if blas[0] == "bundled":
        return ("MLX's bundled reference BLAS (slow: install libopenblas0-pthread, start "
                "via radix-mlx)")
    return blas[0]


def _blas() -> tuple[str, ...]:
    """The BLAS MLX calls on the CPU: ("OpenBLAS", its library, its kernels), ("bundled",)
    (MLX's reference one), ("Accelerate",) or ("unknown",)."""
    if sys.platform == "darwin":
        return ("Accelerate",)
    try:
        mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()}
    except OSError:
        return ("unknown",)
    # numpy's scipy_openblas has prefixed symbols, so MLX never calls into it.
    openblas = sorted(p for p in mapped if "openblas" in p and "scipy_openblas" not in p)
    if openblas:
        return ("OpenBLAS", openblas[0], _openblas_core(openblas[0]))
    return ("bundled",)


def _openblas_core(library: str) -> str:
    try:
        core_name = ctypes.CDLL(library).openblas_get_corename
    except (OSError, AttributeError):
        return "unknown"
    core_name.restype = ctypes.c_char_p
    return core_name().decode()


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


if __name__ == "__main__":
    # `env $(python -m engine.platform_info) CMD`: how the Makefile starts tests and benches.
    print(" ".join(f"{name}={value}" for name, value in cpu_env().items()))
