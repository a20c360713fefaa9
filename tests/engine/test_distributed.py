"""When tensor parallelism is worse than one GPU: the warning `serve` logs at start."""

from engine.distributed import one_gpu_would_be_faster

GIB = 2**30


def test_a_model_that_fits_one_cuda_gpu_is_told_one_gpu_is_faster() -> None:
    warning = one_gpu_would_be_faster(8 * GIB, 2, 140 * GIB, cuda=True)
    assert warning is not None
    assert "16.0 GiB" in warning and "replicas" in warning


def test_a_model_too_big_for_one_gpu_gets_no_warning() -> None:
    assert one_gpu_would_be_faster(60 * GIB, 4, 80 * GIB, cuda=True) is None


def test_ranks_on_cpus_or_macs_get_no_warning() -> None:
    # The measurement behind the warning is CUDA's NCCL; ring and JACCL are other paths.
    assert one_gpu_would_be_faster(1 * GIB, 2, 128 * GIB, cuda=False) is None
