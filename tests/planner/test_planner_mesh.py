"""The planner and the launch-time fit check for a device mesh (HSDP, FSDP2 x TP, x CP): what one
GPU holds follows from the sizes, checked against hand arithmetic; bad meshes fail naming the fix."""

from __future__ import annotations

import subprocess

import pytest
from conftest import PY, python_env

from gpulaunch.caller import fitcheck
from gpulaunch.caller.spec import resolve
from gpulaunch.errors import ConfigurationError, WontFitError
from gpulaunch.hardware.host import GPUInfo, HostInfo
from gpulaunch.options import LaunchOptions
from gpulaunch.planner import plan
from gpulaunch.planner.mesh import resolve_mesh

GiB = 1 << 30
P8B = 8.03e9


def est(mesh, nodes=1, gpus=8, seq=8192, **kw):
    p = plan("llama-3.1-8b", gpu="H100", gpus_per_node=gpus, nodes=nodes, seq_len=seq, mesh=mesh,
             offload=False, **kw)
    return p, p.estimate("fsdp")


@pytest.mark.unit
def test_states_divide_over_shard_context_and_tensor_not_replicas():
    _, fsdp16 = est("shard=16", nodes=2)
    _, hsdp = est("replicate=2,shard=8", nodes=2)
    _, tp = est("shard=4,tensor=2")
    _, flat = est("shard=8")
    # fp32 params + grads + 2 Adam states = 16 B/param over the GPUs that divide them
    assert hsdp.optimizer == pytest.approx(8 * P8B / 8, rel=0.01)
    assert fsdp16.optimizer == pytest.approx(8 * P8B / 16, rel=0.01)
    assert tp.optimizer == pytest.approx(flat.optimizer, rel=0.01)   # 4 x 2 divides like 8
    assert hsdp.peak_allocated > fsdp16.peak_allocated               # replicas hold full shard sets


@pytest.mark.unit
def test_tensor_and_context_parallel_cut_activations():
    _, flat = est("shard=8")
    _, tp = est("shard=4,tensor=2")
    _, cp = est("shard=4,context=2")
    # blocks' activations: half per rank under TP (sequence parallel) and under CP (half the tokens)
    assert tp.activations < 0.75 * flat.activations
    assert cp.activations < 0.6 * flat.activations
    assert tp.peak_allocated < flat.peak_allocated and cp.peak_allocated < flat.peak_allocated


@pytest.mark.unit
def test_mesh_decides_which_techniques_are_planned():
    assert {e.key for e in est("replicate=8")[0].estimates} == {"ddp", "fsdp"}
    assert {e.key for e in est("shard=8")[0].estimates} >= {"fsdp", "zero1", "zero3"}
    assert {e.key for e in est("shard=4,tensor=2")[0].estimates} == {"fsdp"}
    p, _ = est("replicate=2,shard=4")
    assert p.mesh == {"replicate": 2, "shard": 4, "context": 1, "tensor": 1}
    assert "mesh    replicate 2, shard 4" in str(p) and "HSDP" in str(p)
    assert p.to_dict()["mesh"]["shard"] == 4


@pytest.mark.unit
@pytest.mark.parametrize("mesh,match", [
    ("shard=3", "product must equal the GPU count"),
    ("replicate=3", "does not divide the 8 GPUs"),
    ("pipeline=2", "NAME=SIZE pairs of replicate, shard, context, tensor"),
    ({"tensor": 0}, "sizes are >= 1"),
    ("tensor=two", "not an integer"),
])
def test_bad_meshes_name_the_fix(mesh, match):
    with pytest.raises(ValueError, match=match):
        est(mesh)


@pytest.mark.unit
def test_a_strategy_that_cannot_run_the_mesh_is_refused():
    with pytest.raises(ValueError, match="zero3 cannot run the mesh shard 4 x tensor 2: it takes fsdp"):
        plan("llama-3.1-8b", gpu="H100", gpus_per_node=8, mesh="shard=4,tensor=2", strategies=["zero3"])


@pytest.mark.unit
def test_mesh_object_from_gpulaunch_parallel_is_accepted():
    from gpulaunch.parallel import Mesh
    assert resolve_mesh(Mesh(replicate=2, tensor=2), 8) == {"replicate": 2, "shard": 2, "context": 1, "tensor": 2}


def test_plan_cli_takes_a_mesh():
    out = subprocess.run([PY, "-m", "gpulaunch.planner", "plan", "llama-3.1-8b", "--gpu", "H100",
                          "--gpus-per-node", "8", "-s", "8192", "--mesh", "shard=4,tensor=2", "--no-offload"],
                         capture_output=True, text=True, env=python_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "mesh    replicate 1, shard 4, context 1, tensor 2" in out.stdout and "*fsdp" in out.stdout
    bad = subprocess.run([PY, "-m", "gpulaunch.planner", "plan", "llama-3.1-8b", "--gpu", "H100",
                          "--gpus-per-node", "8", "--mesh", "shard=3"], capture_output=True, text=True,
                         env=python_env(), timeout=120)
    assert bad.returncode == 2 and "product must equal the GPU count" in bad.stderr


def _verdict(plan_args, n=8):
    h = HostInfo(gpus=tuple(GPUInfo(i, "NVIDIA H100 80GB HBM3", 81559 << 20) for i in range(n)),
                 cpu_count=64, source="nvml")
    return fitcheck.check_launch(fitcheck.validate(plan_args), resolve(LaunchOptions(gpus=n), h), h)


@pytest.mark.unit
def test_fit_check_plans_the_mesh_of_the_launch():
    # 8K tokens of an 8B model: plain FSDP over 8 GPUs is within 1 GiB of the 80 GiB, FSDP2 x TP 2 fits
    v = _verdict({"model": "llama-3.1-8b", "strategy": "fsdp", "seq_len": 8192, "mesh": "shard=4,tensor=2"})
    assert v.fits and "as a mesh of shard 4 x tensor 2" in v.message
    with pytest.raises(WontFitError, match="as a mesh of replicate 8"):
        _verdict({"model": "llama-3.1-8b", "strategy": "ddp", "mesh": {"replicate": 8}})
    with pytest.raises(ConfigurationError, match="zero3.*cannot run on 8 x H100.*shard 4 x tensor 2; it takes fsdp"):
        _verdict({"model": "llama-3.1-8b", "strategy": "zero3", "mesh": "shard=4,tensor=2"})
    with pytest.raises(ConfigurationError, match="product must equal the GPU count"):
        _verdict({"model": "llama-3.1-8b", "mesh": "shard=4"})


@pytest.mark.unit
def test_fit_check_refuses_a_malformed_mesh_at_decoration():
    with pytest.raises(ConfigurationError, match="plan\\['mesh'\\].*not an integer"):
        fitcheck.validate({"model": "llama-3.1-8b", "mesh": "tensor=x"})
    with pytest.raises(ConfigurationError, match="plan\\['mesh'\\].*unknown dimension"):
        fitcheck.validate({"model": "llama-3.1-8b", "mesh": {"pipeline": 2}})
