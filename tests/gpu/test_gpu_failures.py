"""A GPU rank that fails: an exception, ``os._exit``, SIGKILL, CUDA out of memory, a hang inside
CUDA work. Each reaches the caller with its cause and its rank, and afterwards no process of
the run is alive or holds a GPU context, and the GPUs' memory is back where it was.

On several GPUs the last rank is the culprit while the others wait in a collective it never
joins (so the root-cause rules must pick it over their collateral failures); two more tests
need two GPUs: a rank failing in the middle of a run of all_reduces, and a rank that skips one.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

import pytest

from gpulaunch import runtime as rt

from .helpers import wait_gpu_released

pytestmark = pytest.mark.gpu
HOLD_BYTES = 1 << 30        # each rank holds 1 GiB, so a rank whose memory stayed shows up


def fail_on_gpu(mode: str):
    """Every rank takes a CUDA context and 1 GiB; the last rank then fails as ``mode`` says,
    the others wait in an all_reduce it never joins."""
    import torch
    import torch.distributed as dist
    dev = rt.init()
    rank, world = rt.get_global_rank(), rt.get_world_size()
    hold = torch.ones(HOLD_BYTES, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize(dev)
    if rank != world - 1:
        dist.all_reduce(torch.ones(1, device=dev))
        torch.cuda.synchronize(dev)
        time.sleep(600)
    if mode == "raise":
        raise ValueError(f"boom on GPU rank {rank}")
    if mode == "exit":
        os._exit(7)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "oom":
        torch.empty(1 << 50, dtype=torch.uint8, device=dev)       # 1 PiB
    return int(hold.sum())


def _run_dir(e: BaseException) -> str:
    run_dir = getattr(e, "run_dir", None)
    assert run_dir and Path(run_dir).is_dir(), f"the error carries no run directory: {e!r}"
    return run_dir


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["raise", "exit", "sigkill", "oom"])
def test_a_failing_gpu_rank_reports_its_cause_and_frees_the_gpu(mode, gpu, record, keep):
    import torch

    from gpulaunch import WorkerCrashError, distributed
    culprit = gpu.count - 1
    job = distributed(timeout=90, stream_logs="none")(fail_on_gpu)
    t0 = time.perf_counter()
    expected = {"raise": ValueError, "exit": WorkerCrashError, "sigkill": WorkerCrashError,
                "oom": torch.OutOfMemoryError}[mode]
    with pytest.raises(expected) as info:
        job.distributed(mode)
    seconds = time.perf_counter() - t0
    e = info.value
    keep(getattr(e, "run_dir", None))
    assert e.rank == culprit, (e.rank, str(e)[:2000])
    text = str(e)
    if mode == "raise":
        assert f"boom on GPU rank {culprit}" in text
        assert "fail_on_gpu" in str(e.__cause__), "the remote traceback is not chained"
    elif mode == "exit":
        assert e.exit_code == 7 and "os._exit" in text, text
    elif mode == "sigkill":
        assert e.exit_code == -signal.SIGKILL and "SIGKILL" in text, text
    else:
        assert isinstance(e, torch.cuda.OutOfMemoryError)
        assert "out of memory" in text.lower(), text
        assert "CUDA memory summary" in str(e.__cause__), \
            "the rank's torch.cuda.memory_summary() is missing from the remote traceback"
    released = wait_gpu_released(_run_dir(e), gpu.baseline_mib)
    record(mode=mode, seconds_to_error=round(seconds, 2), **released)


def hang_in_cuda(cycles: int):
    """One all_reduce (the flight recorder's record of it must reach the dump), then a device
    kernel that spins for minutes while the rank's Python waits for it in synchronize()."""
    import torch
    import torch.distributed as dist
    dev = rt.init()
    x = torch.ones(8, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize(dev)
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize(dev)


def _nccl_dump(run_dir: str, rank: int, attempt: int = 0) -> dict:
    path = Path(run_dir) / f"attempt{attempt}" / f"rank{rank}.nccl_trace.pkl"
    assert path.is_file() and path.stat().st_size > 0, (
        f"no NCCL flight-recorder dump of rank {rank} at {path}; the attempt folder holds "
        f"{sorted(p.name for p in path.parent.glob('*'))}")
    with open(path, "rb") as f:
        dump = pickle.load(f)
    assert isinstance(dump, dict) and isinstance(dump.get("entries"), list), \
        f"{path} is not torch's flight-recorder dump: {type(dump)} {list(dump)[:10]}"
    return dump


def _all_reduces(dump: dict) -> list[dict]:
    return [e for e in dump["entries"] if "all_reduce" in str(e.get("profiling_name", ""))]


@pytest.mark.timeout(120)
def test_a_hang_inside_cuda_work_raises_hangerror_with_stacks_and_nccl_dumps(gpu, record, keep):
    from gpulaunch import HangError, distributed
    job = distributed(hang_timeout=6, timeout=100, stream_logs="none")(hang_in_cuda)
    t0 = time.perf_counter()
    with pytest.raises(HangError) as info:
        job.distributed(int(4e11))       # minutes of spinning at any clock this GPU runs
    seconds = time.perf_counter() - t0
    e = info.value
    run_dir = _run_dir(e)
    keep(run_dir)
    assert set(e.stacks) == set(range(gpu.count)), e.stacks.keys()
    for rank, stack in e.stacks.items():
        assert "hang_in_cuda" in stack and "synchronize" in stack, (rank, stack)
    assert "made no progress" in str(e)
    for rank in range(gpu.count):
        assert _all_reduces(_nccl_dump(run_dir, rank)), \
            f"rank {rank}'s flight-recorder dump has no all_reduce entry"
    # a context killed while its kernel spins takes the driver a moment to tear down
    released = wait_gpu_released(run_dir, gpu.baseline_mib, timeout=40)
    record(seconds_to_error=round(seconds, 2), **released)


def fail_mid_collectives(mode: str):
    """Every rank runs all_reduces; the last one fails at the 5th."""
    import torch
    import torch.distributed as dist
    dev = rt.init()
    rank, world = rt.get_global_rank(), rt.get_world_size()
    x = torch.ones(1 << 20, device=dev)
    for i in range(50):
        if rank == world - 1 and i == 5:
            if mode == "raise":
                raise RuntimeError(f"rank {rank} gives up at all_reduce {i}")
            os._exit(3)
        dist.all_reduce(x)
        torch.cuda.synchronize(dev)
    time.sleep(600)


@pytest.mark.gpus(2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_nccl_failure_on_one_of_several_ranks_names_that_rank(mode, gpu, keep):
    from gpulaunch import WorkerCrashError, distributed
    job = distributed(timeout=90, stream_logs="none")(fail_mid_collectives)
    with pytest.raises(RuntimeError if mode == "raise" else WorkerCrashError) as info:
        job.distributed(mode)
    e = info.value
    keep(getattr(e, "run_dir", None))
    assert e.rank == gpu.count - 1, (e.rank, str(e)[:2000])
    if mode == "raise":
        assert "gives up at all_reduce 5" in str(e)
    else:
        assert e.exit_code == 3
    wait_gpu_released(_run_dir(e), gpu.baseline_mib)


def skip_an_all_reduce():
    """The last rank skips the third all_reduce; the others wait for it inside NCCL."""
    import torch
    import torch.distributed as dist
    dev = rt.init()
    rank, world = rt.get_global_rank(), rt.get_world_size()
    x = torch.ones(1024, device=dev)
    for i in range(3):
        if not (rank == world - 1 and i == 2):
            dist.all_reduce(x)
    torch.cuda.synchronize(dev)
    time.sleep(600)


@pytest.mark.gpus(2)
@pytest.mark.timeout(120)
def test_a_rank_that_skips_an_all_reduce_is_a_hang_with_every_stack_and_dump(gpu, keep):
    from gpulaunch import HangError, distributed
    job = distributed(hang_timeout=6, timeout=100, stream_logs="none")(skip_an_all_reduce)
    with pytest.raises(HangError) as info:
        job.distributed()
    e = info.value
    run_dir = _run_dir(e)
    keep(run_dir)
    assert set(e.stacks) == set(range(gpu.count))
    last = gpu.count - 1
    assert "sleep" in e.stacks[last] and "synchronize" in e.stacks[0], e.stacks
    waiting = _all_reduces(_nccl_dump(run_dir, 0))
    skipped = _all_reduces(_nccl_dump(run_dir, last))
    # the dumps show who waits for whom: rank 0 has one all_reduce more, never completed
    assert len(waiting) == len(skipped) + 1, (len(waiting), len(skipped))
    assert waiting[-1].get("state") != "completed", waiting[-1]
    wait_gpu_released(run_dir, gpu.baseline_mib)
