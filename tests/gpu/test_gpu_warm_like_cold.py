"""A warm call (``keep_alive=``) on real GPUs gets what a cold one gets
(tests/gpu/test_gpu_failures.py): a hang inside CUDA work raises HangError with every rank's
stack AND every rank's NCCL flight-recorder dump (the pool's ranks get the same rank
environment, TORCH_NCCL_DEBUG_INFO_TEMP_FILE included, and the same hang routine)."""

from __future__ import annotations

import time

import pytest

from .helpers import wait_gpu_released
from .test_gpu_failures import _all_reduces, _nccl_dump, _run_dir, hang_in_cuda

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(150)
def test_a_warm_hang_inside_cuda_work_has_stacks_and_nccl_dumps(gpu, record, keep):
    import gpulaunch
    from gpulaunch import HangError, distributed
    job = distributed(hang_timeout=6, timeout=100, stream_logs="none", keep_alive=60)(
        hang_in_cuda)
    try:
        t0 = time.perf_counter()
        with pytest.raises(HangError) as info:
            job.distributed(int(4e11))
        seconds = time.perf_counter() - t0
    finally:
        gpulaunch.shutdown()
    e = info.value
    run_dir = _run_dir(e)
    keep(run_dir)
    assert set(e.stacks) == set(range(gpu.count)), e.stacks.keys()
    for rank, stack in e.stacks.items():
        assert "hang_in_cuda" in stack, (rank, stack)
    for rank in range(gpu.count):
        assert _all_reduces(_nccl_dump(run_dir, rank)), \
            f"warm rank {rank}'s flight-recorder dump has no all_reduce entry"
    released = wait_gpu_released(run_dir, gpu.baseline_mib, timeout=40)
    record(warm_seconds_to_error=round(seconds, 2), **released)
