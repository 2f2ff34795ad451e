"""Each mesh layout trains like single-process PyTorch: HSDP, tensor parallel, FSDP2 x TP, HSDP x TP
(and a Hugging Face Llama under the built-in HF tensor plan), on real CPU ranks (gloo) through
gpulaunch's own launcher; checkpoints saved under one layout load under another.

The reference is plain single-process PyTorch on the concatenated global batch (no gpulaunch).
Every data-parallel rank (``p.data_rank`` of ``p.data_size``) reads its slice of the global batch;
the ranks of one tensor-parallel group read the same slice. Tolerance (fp32) as in
tests/test_parallel.py: the layouts differ from the reference only in the order of floating-point
sums (sharded matmuls, all-reduces, reduce-scatters), ~1e-7 per step; ``ATOL`` = 1e-5 over the
steps leaves ~20x headroom, while a wrong gradient scale (a TP gradient not reduced, a replica
group averaged twice) moves the losses by > 1e-2 within a few steps.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from gpulaunch import parallel as gp
from gpulaunch.parallel import Mesh
from gpulaunch.parallel.reference_model import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
GLOBAL_BATCH, SEQ, STEPS, SAVE_AT, LR, ATOL = 4, 16, 8, 4, 3e-3, 1e-5
# the global gradient norm is ~1 here: clipping at 0.5 acts on every step, so a norm summed
# wrongly over sharded or tensor-parallel gradients changes the losses
CLIP = 0.5
PROBE = torch.arange(2 * SEQ).reshape(2, SEQ) % CFG.vocab_size


def run_ranks(fn, *args, world):
    from gpulaunch import distributed
    from gpulaunch import runtime as rt

    @distributed(gpus=world, stream_logs="none", timeout=300)
    def job(*a):
        rt.init()
        return fn(*a)

    return job.distributed(*args)


def global_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % CFG.vocab_size
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def make_model(seed=0):
    torch.manual_seed(seed)
    return Llama(CFG)


def opt_factory(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


_REF = {}


def reference():
    """Plain single-process PyTorch on the global batch: no gpulaunch involved."""
    if not _REF:
        model = make_model(0)
        opt = opt_factory(model.parameters())
        losses = []
        for step in range(1, STEPS + 1):
            x, y = global_batch(step)
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():
            _REF["probe"] = model(PROBE)
        _REF["losses"] = losses
    return _REF["losses"], _REF["probe"]


def _train(p, steps, losses):
    for step in steps:
        x, y = global_batch(step)
        n = GLOBAL_BATCH // p.data_size
        x, y = x[p.data_rank * n:(p.data_rank + 1) * n], y[p.data_rank * n:(p.data_rank + 1) * n]
        loss = p.model(x, y)
        p.backward(loss)
        p.step()
        p.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)   # every rank of a tensor group holds its data rank's loss: the mean is the data mean
        losses.append(t.item() / dist.get_world_size())


def job_layout(mesh_sizes, root, ac):
    """Train under ``mesh_sizes``, saving at SAVE_AT; return losses, a probe and the layout seen."""
    p = gp.prepare(make_model(0), opt_factory, strategy="auto", mesh=Mesh(**mesh_sizes),
                   activation_checkpointing=ac, max_grad_norm=CLIP)
    losses = []
    _train(p, range(1, SAVE_AT + 1), losses)
    if root:
        gp.save_checkpoint(root, p, step=SAVE_AT, extra=dict(mesh_sizes))
    _train(p, range(SAVE_AT + 1, STEPS + 1), losses)
    with torch.no_grad():
        probe = p.model(PROBE).float()
    return {"losses": losses, "probe": probe, "strategy": p.strategy, "data": (p.data_rank, p.data_size),
            "coords": p.mesh.coordinates(), "mesh": str(p.mesh.spec)}


def job_resume_under(mesh_sizes, root):
    """A fresh model from another init, loaded from a checkpoint of another layout, trained on."""
    p = gp.prepare(make_model(seed=123), opt_factory, strategy="auto", mesh=Mesh(**mesh_sizes), max_grad_norm=CLIP)
    info = gp.load_checkpoint(root, p)
    losses = []
    _train(p, range(info["step"] + 1, STEPS + 1), losses)
    return {"losses": losses, "extra": info["extra"]}


LAYOUTS = {
    # name: (mesh, world, activation checkpointing)
    "hsdp_2x2": ({"replicate": 2, "shard": 2}, 4, False),
    "tp_2": ({"tensor": 2}, 2, False),
    "fsdp_x_tp_2x2": ({"shard": 2, "tensor": 2}, 4, "selective"),
    "hsdp_x_tp_2x1x2": ({"replicate": 2, "shard": 1, "tensor": 2}, 4, "full"),
}
_RUNS = {}


def layout_run(name, tmp_path_factory):
    if name not in _RUNS:
        mesh, world, ac = LAYOUTS[name]
        root = str(tmp_path_factory.mktemp(f"ckpt_{name}"))
        _RUNS[name] = (run_ranks(job_layout, mesh, root, ac, world=world), root)
    return _RUNS[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(name, tmp_path_factory):
    res, _ = layout_run(name, tmp_path_factory)
    ref, ref_probe = reference()
    mesh, world, _ = LAYOUTS[name]
    r0 = res[0]
    assert r0["strategy"] == "fsdp"
    assert all(r["losses"] == r0["losses"] for r in res)
    assert r0["losses"][-1] < r0["losses"][0] - 0.2, r0["losses"]
    diff = max(abs(a - b) for a, b in zip(r0["losses"], ref))
    assert diff <= ATOL, f"{name}: max |loss - reference| = {diff:.3g}\n{r0['losses']}\n{ref}"
    torch.testing.assert_close(r0["probe"], ref_probe, rtol=0, atol=1e-4)
    # the layout is the one asked for: data ranks read different slices, tensor ranks the same one
    tensor = mesh.get("tensor", 1)
    data = sorted({r["data"] for r in res})
    assert data == [(i, world // tensor) for i in range(world // tensor)]
    assert sorted(r["coords"]["tensor"] for r in res) == sorted(list(range(tensor)) * (world // tensor))


def job_hsdp_equals_ddp_and_fsdp():
    """The same 4 ranks and data, three layouts: DDP, FSDP2 over 4, HSDP 2 x 2."""
    out = {}
    for name, strategy, mesh in [("ddp", "ddp", None), ("fsdp", "fsdp", None),
                                 ("hsdp", "fsdp", Mesh(replicate=2, shard=2))]:
        p = gp.prepare(make_model(0), opt_factory, strategy=strategy, mesh=mesh, max_grad_norm=CLIP)
        losses = []
        _train(p, range(1, STEPS + 1), losses)
        out[name] = losses
    return out


@pytest.mark.slow
def test_hsdp_equals_ddp_and_fsdp_on_four_ranks():
    res = run_ranks(job_hsdp_equals_ddp_and_fsdp, world=4)[0]
    for a in ("fsdp", "hsdp"):
        diff = max(abs(x - y) for x, y in zip(res[a], res["ddp"]))
        assert diff <= ATOL, (a, res[a], res["ddp"])


@pytest.mark.slow
@pytest.mark.parametrize("saved,loaded,world", [
    ("fsdp_x_tp_2x2", {"replicate": 2, "shard": 2}, 4),    # FSDP x TP -> HSDP
    ("hsdp_2x2", {"tensor": 2}, 2),                         # HSDP on 4 -> TP on 2
])
def test_checkpoint_saved_under_one_layout_resumes_under_another(saved, loaded, world, tmp_path_factory):
    res, root = layout_run(saved, tmp_path_factory)
    meta = gp.checkpoint._meta(gp.latest_checkpoint(root))
    assert meta["mesh"] == {**{"replicate": 1, "shard": 1, "context": 1, "tensor": 1},
                            **Mesh(**LAYOUTS[saved][0]).resolve(LAYOUTS[saved][1]).sizes}
    got = run_ranks(job_resume_under, loaded, root, world=world)[0]
    assert got["extra"] == LAYOUTS[saved][0]
    diff = max(abs(a - b) for a, b in zip(got["losses"], res[0]["losses"][SAVE_AT:]))
    assert diff <= ATOL, (got["losses"], res[0]["losses"][SAVE_AT:])


@pytest.mark.slow
def test_tensor_parallel_checkpoint_exports_and_loads_in_one_process(tmp_path_factory, tmp_path):
    res, root = layout_run("fsdp_x_tp_2x2", tmp_path_factory)
    sd = gp.export(root, str(tmp_path / "model.pt"))
    plain = Llama(CFG)
    plain.load_state_dict(sd, strict=True)
    p = gp.prepare(make_model(seed=5), opt_factory, strategy="none")
    assert gp.load_checkpoint(root, p)["step"] == SAVE_AT
    for a, b in zip(plain.parameters(), p.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    os.remove(tmp_path / "model.pt")


def _hf_llama(seed):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(HFConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                     attn_implementation="sdpa"))


def job_hf_tensor_parallel():
    """A Hugging Face Llama under the built-in HF tensor plan, against the same model in this process
    alone (rank 0 runs both; every rank runs the TP one)."""
    def train(model_or_prepared, prepared):
        losses = []
        for step in range(1, STEPS + 1):
            x, y = global_batch(step)
            model = model_or_prepared.model if prepared else model_or_prepared
            loss = model(input_ids=x, labels=x).loss
            if prepared:
                model_or_prepared.backward(loss)
                model_or_prepared.step()
                model_or_prepared.zero_grad()
            else:
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        return losses

    plain = _hf_llama(0)
    opt = opt_factory(plain.parameters())
    ref = train(plain, False)
    p = gp.prepare(_hf_llama(0), opt_factory, strategy="fsdp", mesh=Mesh(tensor=2))
    from torch.distributed.tensor import DTensor
    split = sorted(n for n, prm in p.model.named_parameters() if isinstance(prm, DTensor))
    return {"ref": ref, "tp": train(p, True), "split": split}


@pytest.mark.slow
def test_hugging_face_llama_under_the_built_in_tensor_plan():
    pytest.importorskip("transformers")
    r = run_ranks(job_hf_tensor_parallel, world=2)[0]
    assert "model.layers.0.self_attn.q_proj.weight" in r["split"] and "model.layers.1.mlp.down_proj.weight" in r["split"]
    assert not any("embed_tokens" in n or "norm" in n for n in r["split"])   # replicated, not split
    assert r["ref"][-1] < r["ref"][0] - 0.2, r["ref"]
    diff = max(abs(a - b) for a, b in zip(r["tp"], r["ref"]))
    assert diff <= ATOL, (r["tp"], r["ref"])


def job_tp_warm(steps):
    from gpulaunch import runtime as rt
    rt.init()
    p = gp.prepare(make_model(0), opt_factory, strategy="fsdp", mesh=Mesh(shard=1, tensor=2), max_grad_norm=CLIP)
    losses = []
    _train(p, range(1, steps + 1), losses)
    return os.getpid(), losses


@pytest.mark.slow
def test_a_warm_pool_builds_the_mesh_again_on_each_call():
    """keep_alive ranks keep their process group: the second call builds a new mesh in it."""
    import gpulaunch
    from gpulaunch import distributed

    job = distributed(gpus=2, keep_alive=60, timeout=300, stream_logs="none")(job_tp_warm)
    try:
        first = job.distributed(4)
        second = job.distributed(4)
    finally:
        gpulaunch.shutdown()
    assert [pid for pid, _ in first] == [pid for pid, _ in second]   # the same (warm) ranks
    ref, _ = reference()
    for _, losses in first + second:
        assert max(abs(a - b) for a, b in zip(losses, ref[:4])) <= ATOL, (losses, ref[:4])
