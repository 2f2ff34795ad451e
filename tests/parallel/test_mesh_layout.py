"""Mesh(replicate, shard, context, tensor): validation and how prepare() picks a strategy for it.
Pure logic, no processes (the layouts themselves train in test_mesh_training.py)."""

from __future__ import annotations

import pytest
import torch

from gpulaunch import parallel as gp
from gpulaunch.parallel import auto
from gpulaunch.parallel.mesh import Mesh, as_mesh
from gpulaunch.parallel.reference_model import Llama, LlamaConfig

pytestmark = pytest.mark.unit


def test_shard_takes_what_the_others_leave():
    assert Mesh().resolve(8) == Mesh(1, 8, 1, 1)
    assert Mesh(replicate=2).resolve(8) == Mesh(2, 4, 1, 1)
    assert Mesh(replicate=2, tensor=2).resolve(8).shard == 2
    assert Mesh(shard=2, context=2, tensor=2).resolve(8).size == 8
    assert Mesh(replicate=2, shard=4).data_parallel == 8
    assert Mesh(shard=4, tensor=2).resolve(8).data_parallel == 4


@pytest.mark.parametrize("mesh,world,match", [
    (Mesh(replicate=2, shard=2), 8, "product must equal the world size"),
    (Mesh(replicate=3), 8, "does not divide 8"),
    (Mesh(tensor=16), 8, "does not divide 8"),
])
def test_sizes_that_cannot_fill_the_world(mesh, world, match):
    with pytest.raises(gp.ParallelError, match=match):
        mesh.resolve(world)


def test_bad_sizes_are_refused_when_built():
    with pytest.raises(gp.ParallelError, match="sizes are >= 1"):
        Mesh(tensor=0)
    with pytest.raises(gp.ParallelError, match="shard=-1 means"):
        Mesh(shard=-2)
    with pytest.raises(gp.ParallelError, match="takes an int"):
        Mesh(replicate=2.0)
    with pytest.raises(gp.ParallelError, match="takes an int"):
        Mesh(tensor=True)
    with pytest.raises(gp.ParallelError, match="unknown dimension.*pipeline"):
        as_mesh({"pipeline": 2})
    with pytest.raises(gp.ParallelError, match="Mesh\\(replicate="):
        as_mesh((2, 2))
    assert as_mesh({"replicate": 2, "shard": 2}) == Mesh(2, 2)
    assert str(Mesh(replicate=2, shard=4)) == "Mesh(replicate=2, shard=4)"


def test_auto_follows_the_mesh():
    assert auto.strategy_for_mesh(Mesh(replicate=4).resolve(4))[0] == "ddp"
    assert auto.strategy_for_mesh(Mesh(replicate=2, shard=2))[0] == "fsdp"
    assert "HSDP" in auto.strategy_for_mesh(Mesh(replicate=2, shard=2))[1]
    assert auto.strategy_for_mesh(Mesh(tensor=2).resolve(2))[0] == "fsdp"


def test_prepare_refuses_layouts_a_strategy_cannot_take(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    m = Llama(LlamaConfig())
    opt = lambda ps: torch.optim.AdamW(ps)
    with pytest.raises(gp.ParallelError, match="process group"):   # a layout that fits reaches the group check
        gp.prepare(m, opt, strategy="fsdp", mesh=Mesh(replicate=2, shard=2))
    with pytest.raises(gp.ParallelError, match="product must equal"):
        gp.prepare(m, opt, strategy="fsdp", mesh=Mesh(replicate=2, shard=4))
    with pytest.raises(gp.ParallelError, match="needs CUDA GPUs.*CPU SDPA"):
        gp.prepare(m, opt, strategy="fsdp", mesh=Mesh(context=2), device="cpu")
    with pytest.raises(gp.ParallelError, match="tensor_plan= applies with mesh=Mesh\\(tensor=N\\)"):
        gp.prepare(m, opt, strategy="fsdp", tensor_plan={})
    with pytest.raises(gp.ParallelError, match="fp8_recipe"):
        gp.prepare(m, opt, strategy="none", fp8_recipe="blockwise")
    with pytest.raises(gp.ParallelError, match="'selective'"):
        gp.prepare(m, opt, strategy="none", activation_checkpointing="some")


def test_strategy_checks_its_mesh(monkeypatch):
    """Checked before the process group: the message names the strategy that takes the layout."""
    from gpulaunch.parallel.settings import PrepareSettings
    from gpulaunch.parallel.strategies import strategy_object

    monkeypatch.setenv("WORLD_SIZE", "4")

    def settings(name, mesh):
        return PrepareSettings.from_arguments(strategy=name, device=torch.device("cpu"), mesh=mesh)

    with pytest.raises(gp.ParallelError, match="only replicates.*strategy='fsdp'"):
        strategy_object("ddp").mesh(settings("ddp", Mesh(replicate=2, shard=2)))
    assert strategy_object("ddp").mesh(settings("ddp", Mesh(replicate=4))) == Mesh(4, 1)
    with pytest.raises(gp.ParallelError, match="ZeRO.*needs strategy='fsdp'"):
        strategy_object("zero3").mesh(settings("zero3", Mesh(shard=2, tensor=2)))
    assert strategy_object("zero3").mesh(settings("zero3", Mesh(shard=4))) is None
    with pytest.raises(gp.ParallelError, match="strategy='none' takes no mesh"):
        strategy_object("none").mesh(settings("none", Mesh(replicate=4)))
    assert strategy_object("fsdp").mesh(settings("fsdp", Mesh(replicate=2))) == Mesh(2, 2)


def test_tensor_plan_for_the_reference_model_and_its_limits():
    from gpulaunch.parallel.tensor_parallel import default_plan

    plan = default_plan(Llama(LlamaConfig(n_layers=2)), 2)
    assert {"tok_emb", "norm", "lm_head", "layers.1.attn.wq", "layers.1.mlp.w2"} <= set(plan)
    with pytest.raises(gp.ParallelError, match="must divide the model's attention heads"):
        default_plan(Llama(LlamaConfig(n_heads=4, n_kv_heads=2)), 4)
    with pytest.raises(gp.ParallelError, match="tie_embeddings=False"):
        default_plan(Llama(LlamaConfig(tie_embeddings=True)), 2)
    with pytest.raises(gp.ParallelError, match="no built-in one for Sequential.*tensor_plan="):
        default_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2)
