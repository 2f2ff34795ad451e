"""The notebook tools on real GPU ranks: stacks of ranks busy in CUDA work, the failing
frame's CUDA tensors described without being copied, the panel's NVML column, and a pdb
session in a failing GPU rank. One rank per GPU of the host."""

from __future__ import annotations

import io
import os
import time

import pytest

from gpulaunch import distributed
from gpulaunch.caller.debug_client import attach
from gpulaunch.common.rundir import RunDir
from gpulaunch.notebook import gpus, model

pytestmark = pytest.mark.gpu


def _ngpu() -> int:
    from gpulaunch.hardware import nvml
    return max(1, len(nvml.devices() or []))


def busy_on_gpu(flag_dir):
    import torch

    from gpulaunch import runtime as rt
    dev = rt.init()
    hold = torch.ones(1 << 28, dtype=torch.uint8, device=dev)      # 256 MiB: NVML sees it
    x = torch.randn(2048, 2048, device=dev)

    def multiply_on_the_gpu():
        open(os.path.join(flag_dir, f"ready{rt.get_global_rank()}"), "w").close()
        y = x
        while not os.path.exists(os.path.join(flag_dir, "stop")):
            y = (y @ x).tanh()
            torch.cuda.synchronize(dev)
        return float(y[0, 0])

    multiply_on_the_gpu()
    del hold
    return rt.get_global_rank()


def _wait_for(pred, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.timeout(240)
def test_stacks_and_panel_gpu_column_on_busy_gpu_ranks(tmp_path):
    n = _ngpu()
    flags = tmp_path / "flags"
    flags.mkdir()
    h = distributed(gpus=n, stream_logs="none")(busy_on_gpu).submit(str(flags))
    try:
        assert _wait_for(lambda: all((flags / f"ready{r}").exists() for r in range(n)))
        stacks = h.stacks()
        assert sorted(stacks) == list(range(n))
        for r in range(n):
            assert "in multiply_on_the_gpu" in stacks[r], stacks[r]
        run = RunDir(h.run_dir)
        readings = gpus.read(run.launch().spec)     # what the panel's view reads
        state = model.build(run, gpus=readings)
        for row in state.rows:
            assert row.device.startswith("cuda:") and row.state == "running"
            assert row.gpu.get("memory_usage_megabytes", 0) > 256, row.gpu
    finally:
        (flags / "stop").touch()
    assert h.result(timeout=120) == list(range(n))


def fails_with_a_cuda_tensor():
    import torch

    from gpulaunch import runtime as rt
    dev = rt.init()
    activations = torch.zeros(64, 1024, device=dev, dtype=torch.bfloat16)
    scale = 3
    if rt.get_global_rank() == 0:
        raise FloatingPointError(f"nan in {activations.shape[0]} rows")
    return scale


@pytest.mark.timeout(240)
def test_locals_and_a_pdb_session_of_a_failing_gpu_rank():
    h = distributed(gpus=1, stream_logs="none", debug=True)(fails_with_a_cuda_tensor).submit()
    out = io.StringIO()
    attach(RunDir(h.run_dir), 0, wait=120,
           stdin=io.StringIO("p scale\np str(activations.device)\nc\n"), stdout=out)
    text = out.getvalue()
    # pdb's `p` prints a repr: the str() makes it 'cuda:0' (the 2026-12-04 run printed
    # device(type='cuda', index=0) for a bare `p activations.device`: the session worked)
    assert "(Pdb) 3\n" in text and "(Pdb) 'cuda:0'\n" in text, text
    with pytest.raises(FloatingPointError) as info:
        h.result(timeout=120)
    msg = str(info.value.__cause__ or "") + getattr(info.value, "remote_traceback", "")
    assert "activations: torch.Tensor shape (64, 1024) torch.bfloat16 on cuda:0" in msg, msg
