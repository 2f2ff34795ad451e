"""``prepare(mesh=Mesh(...))`` on GPUs: tensor parallel, FSDP2 x TP, HSDP and context parallel
against the single-process loop, and the FP8 recipes and selective activation checkpointing on one
GPU. Multi-GPU tests skip on hosts with fewer GPUs (``gpus(n)``).

Equivalence runs in fp32 without TF32, with one SDPA kernel for the reference and the layout
(math for TP/HSDP; memory-efficient for CP, whose ring attention needs a CUDA kernel), within
``FP32_RTOL`` = 1e-3 relative: the CPU rehearsal of the same layouts (tests/parallel/
test_mesh_training.py, gloo) agreed to < 1e-6, and a missed gradient reduction or a wrong
sequence shard (RoPE positions) moves the loss by > 1e-2 within a few steps. FP8 and selective AC
train in bf16 and are held to ``BF16_ATOL`` = 0.1 of the bf16 loop (tests/gpu/test_gpu_parallel.py
explains that tolerance) and must learn.
"""

from __future__ import annotations

import math

import pytest

from gpulaunch import runtime as rt

from .helpers import require

pytestmark = pytest.mark.gpu
CFG = {"vocab_size": 512, "dim": 512, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4,
       "ffn_dim": 2048, "max_seq_len": 128}
SEQ, GLOBAL_BATCH, STEPS, LR = 128, 4, 8, 1e-3
FP32_RTOL, BF16_ATOL, MIN_DROP = 1e-3, 0.1, 0.5


def _batch(rank: int, world: int):
    import torch
    g = torch.Generator().manual_seed(1000)
    v = CFG["vocab_size"]
    start = torch.randint(0, v, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % v
    n = GLOBAL_BATCH // world
    return seq[rank * n:(rank + 1) * n, :-1].contiguous(), seq[rank * n:(rank + 1) * n, 1:].contiguous()


def train_layouts(layouts: list[dict], kernel: str) -> dict:
    """The plain loop on the global batch, then each layout from the same weights and data."""
    import torch
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gpulaunch import parallel as gp
    from gpulaunch.parallel.reference_model import Llama, LlamaConfig
    dev = rt.init()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sdpa_kernel([getattr(SDPBackend, kernel)]).__enter__()

    def model(seed):
        torch.manual_seed(seed)
        return Llama(LlamaConfig(**CFG))

    def opt(ps):
        return torch.optim.AdamW(ps, lr=LR, weight_decay=0.01)

    ref = model(0).to(dev)
    ref_opt = opt(ref.parameters())
    reference = []
    for _ in range(STEPS):
        x, y = (t.to(dev) for t in _batch(0, 1))
        loss = ref(x, y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        reference.append(loss.item())
    del ref, ref_opt
    out = {"reference": reference, "layouts": {}}
    for sizes in layouts:
        p = gp.prepare(model(0), opt, strategy="fsdp", mesh=gp.Mesh(**sizes))
        losses = []
        for _ in range(STEPS):
            x, y = (t.to(dev) for t in _batch(p.data_rank, p.data_size))
            if sizes.get("context", 1) > 1:
                pos = torch.arange(SEQ, device=dev)
                with p.context_parallel(x, y, pos):
                    loss = p.model(x, y, positions=pos)
                    p.backward(loss)
            else:
                loss = p.model(x, y)
                p.backward(loss)
            p.step()
            p.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / dist.get_world_size())
        out["layouts"][str(p.mesh.spec)] = losses
        del p
        torch.cuda.empty_cache()
    return out


def _launch(fn, *args, gpus=None):
    from gpulaunch import distributed
    return distributed(gpus=gpus, timeout=300, stream_logs="rank0")(fn).distributed(*args)


def _assert_equal_to_reference(r, record):
    ref = r["reference"]
    record(reference=ref, layouts=r["layouts"])
    assert ref[-1] < ref[0] - MIN_DROP, ref
    for name, losses in r["layouts"].items():
        for step, (a, b) in enumerate(zip(losses, ref), 1):
            assert abs(a - b) <= FP32_RTOL * abs(b), (name, step, losses, ref)


@pytest.mark.gpus(2)
@pytest.mark.timeout(300)
def test_tensor_parallel_matches_the_single_process_loop(gpu, record):
    _assert_equal_to_reference(_launch(train_layouts, [{"tensor": 2}], "MATH", gpus=2)[0], record)


@pytest.mark.gpus(4)
@pytest.mark.timeout(300)
def test_hsdp_and_fsdp_x_tp_match_the_single_process_loop(gpu, record):
    layouts = [{"replicate": 2, "shard": 2}, {"shard": 2, "tensor": 2}]
    _assert_equal_to_reference(_launch(train_layouts, layouts, "MATH", gpus=4)[0], record)


@pytest.mark.gpus(2)
@pytest.mark.timeout(300)
def test_context_parallel_matches_the_single_process_loop(gpu, record):
    # the ring runs the CUDA memory-efficient kernel (fp32-capable); the reference uses it too
    _assert_equal_to_reference(_launch(train_layouts, [{"context": 2}], "EFFICIENT_ATTENTION", gpus=2)[0],
                               record)


def train_one_gpu_variants() -> dict:
    """bf16 loop, selective AC + compile, FP8 tensorwise and rowwise (+ compile), on one GPU."""
    import torch

    from gpulaunch import parallel as gp
    from gpulaunch.parallel.reference_model import Llama, LlamaConfig
    dev = rt.init()

    def run(**kw):
        torch.manual_seed(0)
        p = gp.prepare(Llama(LlamaConfig(**CFG)), lambda ps: torch.optim.AdamW(ps, lr=LR), strategy="none",
                       mixed_precision="bf16", **kw)
        losses = []
        for _ in range(STEPS):
            x, y = (t.to(dev) for t in _batch(0, 1))
            loss = p.model(x, y)
            p.backward(loss)
            p.step()
            p.zero_grad()
            losses.append(loss.item())
        return losses

    out = {"bf16": run(), "selective_ac_compiled": run(activation_checkpointing="selective", compile=True)}
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) >= (8, 9):
        out["fp8_tensorwise"] = run(precision="fp8", fp8_recipe="tensorwise", compile=True)
        out["fp8_rowwise"] = run(precision="fp8", fp8_recipe="rowwise", compile=True)
    return out


@pytest.mark.timeout(300)
def test_selective_ac_and_fp8_recipes_train_like_bf16(gpu, record):
    require("torchao", "torchao (bench/torchtitan_gpu_wheels.sh carries torchao 0.17.0)", load=False)
    r = _launch(train_one_gpu_variants, gpus=1)[0]
    record(**r)
    ref = r["bf16"]
    assert ref[-1] < ref[0] - MIN_DROP, ref
    for name, losses in r.items():
        assert all(math.isfinite(v) for v in losses), (name, losses)
        assert max(abs(a - b) for a, b in zip(losses, ref)) <= BF16_ATOL, (name, losses, ref)
        assert losses[-1] < losses[0] - MIN_DROP, (name, losses)
