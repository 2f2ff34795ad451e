"""Launching on GPUs: a rank on every GPU with per-rank results, CUDA results reaching the caller
as CPU tensors while the caller never initialises CUDA, the launch-time numbers a user feels
(recorded, not asserted), and the refusals of a GPU type or count this host does not have."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import ROOT, write_out

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(240)
def test_every_gpu_gets_a_rank_and_cuda_results_reach_a_caller_that_never_touches_cuda(
        gpu, record, tmp_path):
    """One fresh caller process (caller_probe.py): three init + all_reduce calls on every GPU
    (gpus=None, gpu_type= this host's), then a call whose ranks return CUDA tensors in nested
    containers. ~30 s on one H200."""
    out = tmp_path / "probe.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    proc = subprocess.run([sys.executable, str(HERE / "caller_probe.py"), str(out),
                           gpu.type_name or ""], check=False, env=env, capture_output=True,
                          text=True, timeout=220)
    assert proc.returncode == 0 and out.exists(), (
        f"caller_probe.py exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    p = json.loads(out.read_text())
    assert p["error"] is None, p["error"]

    n = gpu.count
    for call in p["calls"]:
        ranks = call["ranks"]
        assert [r["rank"] for r in ranks] == list(range(n)), call
        assert {r["world"] for r in ranks} == {n}
        assert [r["device"] for r in ranks] == [f"cuda:{i}" for i in range(n)]
        assert [r["current_device"] for r in ranks] == list(range(n))
        assert len({r["uuid"] for r in ranks}) == n, "two ranks share a GPU"
        assert {r["backend"] for r in ranks} == {"nccl"}
        assert {r["sum"] for r in ranks} == {n * (n + 1) / 2}, "the all_reduce is wrong"
        assert len({r["pid"] for r in ranks}) == n
        assert all(gpu.name.split()[-1] in r["name"] for r in ranks), (gpu.name, ranks)

    cuda = p["cuda_results"]
    assert not cuda["problems"], "\n".join(cuda["problems"])
    assert len(cuda["tensors"]) >= 11 * n, cuda["tensors"]   # every nested tensor was seen
    caller = p["caller"]
    assert caller["cuda_initialized"] is False, \
        "the caller initialised CUDA (it received CUDA tensors, or launching touched a GPU)"
    assert p["pid"] not in caller["compute_app_pids"], \
        f"the caller (pid {p['pid']}) holds a CUDA context: {caller['compute_app_pids']}"

    times = {c["label"]: {k: c[k] for k in ("whole_s", "to_function_s", "to_process_group_s",
                                           "to_first_collective_s", "idle_before_s")}
             for c in p["calls"]}
    record(import_torch_s=p["import_torch_s"], calls=times)
    write_out("gpu-launch-times.json", {
        "what": "seconds after .distributed() was called until: the fastest rank entered "
                "the function (to_function_s), the slowest had its process group "
                "(to_process_group_s), the slowest finished its first NCCL all_reduce, "
                "synchronised (to_first_collective_s), and the call returned (whole_s); "
                "three calls in one fresh caller process, the third after idle_before_s of "
                "idle; recorded, not asserted",
        "gpus": n, "gpu": gpu.name, "caller_import_torch_s": p["import_torch_s"],
        "calls": times})


@pytest.mark.timeout(60)
def test_a_gpu_type_or_count_this_host_lacks_is_refused_before_anything_starts(
        gpu, gpulaunch_home):
    from gpulaunch import GPUType, GPUTypeError, GPUValidationError, distributed

    def f():
        return 1

    other = next(t for t in GPUType if t.name != gpu.type_name)
    with pytest.raises(GPUTypeError) as e:
        distributed(gpu_type=other.name)(f).distributed()
    msg = str(e.value)
    assert other.name in msg and gpu.name in msg, msg           # what was asked, what is here
    assert isinstance(e.value, ValueError)

    with pytest.raises(GPUValidationError) as e:
        distributed(gpus=gpu.count + 1)(f).distributed()
    msg = str(e.value)
    assert f"gpus={gpu.count + 1}" in msg and f"{gpu.count} GPU" in msg, msg

    # what the host has is accepted (resolved, nothing launched)
    assert gpu.type_name, f"gpulaunch has no GPUType for {gpu.name!r}"
    fine = distributed(gpus=gpu.count, gpu_type=gpu.type_name.lower())(f)
    assert fine.gpus_per_node == gpu.count
    runs = gpulaunch_home / "runs"
    assert not runs.exists() or not any(runs.iterdir()), "a refused launch left a run directory"
