"""``gpulaunch.parallel.prepare()`` on GPUs: none / DDP / FSDP2 / ZeRO-1/2/3 in bf16 on a small
Llama-shaped model (the package's reference model), one launch for all of them.

In each rank: first the plain loop (no gpulaunch.parallel: the global batch in one process, bf16
autocast over fp32 weights, AdamW), then every strategy from the same initial weights on the
same data. Each must give finite losses within ``BF16_ATOL`` of the plain loop at every step and
learn (last loss below the first by ``MIN_DROP``); then a checkpoint is saved, loaded into a
model built from another seed, and that model's logits on a probe batch must equal the saved
model's within ``PROBE_ATOL``.

Tolerances: bf16 is not bit-reproducible across these code paths (autocast for none/DDP, bf16
parameters for FSDP2's MixedPrecisionPolicy and for DeepSpeed), so losses differ by rounding.
Rehearsed on CPU (gloo, same code, 2026-12-03): the loss falls 5.60 -> 2.27 in 10 steps; none
equals the plain loop exactly, DDP (2 ranks) is within 2.2e-3, FSDP2 1.6e-2, ZeRO-1/2/3 1.5e-2,
so ``BF16_ATOL`` = 0.1 leaves ~6x headroom while a strategy that does not train (a missed step,
an optimizer on stale parameters, a lost update) stays near 5.6, off by more than 1. The
probe: a model not restored (another seed, untrained) is off by the trained logits themselves
(their spread is recorded as ``probe_spread``); a restored one was off by 0 (CPU).

On two or more GPUs a second test checks world-size-N equivalence in fp32: DDP, FSDP2 and
ZeRO-2 on N ranks against the single-process loop on the global batch, within 1e-3 relative
(CPU rehearsal, 2 ranks: 4.8e-7 absolute for all three).
"""

from __future__ import annotations

import math

import pytest

from gpulaunch import runtime as rt

from .helpers import require

pytestmark = pytest.mark.gpu
CFG = {"vocab_size": 256, "dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4,
       "ffn_dim": 512, "max_seq_len": 64}
SEQ, GLOBAL_BATCH, STEPS, LR = 64, 8, 10, 1e-3
STRATEGIES = ["none", "ddp", "fsdp", "zero1", "zero2", "zero3"]
BF16_ATOL, MIN_DROP, PROBE_ATOL = 0.1, 1.0, 2e-2
FP32_RTOL = 1e-3
WRAPPERS = {"none": "Llama", "ddp": "DistributedDataParallel", "fsdp": "FSDPLlama",
            "zero1": "DeepSpeedEngine", "zero2": "DeepSpeedEngine", "zero3": "DeepSpeedEngine"}


def _batch(step: int, rank: int, world: int):
    """The global batch (each row an arithmetic progression mod vocab), this rank's slice. The
    same batch every step (``step`` is unused): memorising it gives a smooth loss curve that
    runs can be compared on. With a fresh batch per step, bf16 runs drift apart chaotically
    (measured on CPU: autocast and bf16-parameter runs 0.35 apart after 7 steps at lr 3e-3),
    which would hide a real difference in noise."""
    import torch
    g = torch.Generator().manual_seed(1000)
    v = CFG["vocab_size"]
    start = torch.randint(0, v, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % v
    n = GLOBAL_BATCH // world
    x, y = seq[:, :-1], seq[:, 1:]
    return x[rank * n:(rank + 1) * n].contiguous(), y[rank * n:(rank + 1) * n].contiguous()


def train_every_strategy(root: str, strategies: list, mixed: str | None) -> dict:
    import torch
    import torch.distributed as dist

    from gpulaunch import parallel as gp
    from gpulaunch.parallel.reference_model import Llama, LlamaConfig
    dev = rt.init()
    rank, world = rt.get_global_rank(), rt.get_world_size()
    if mixed is None:           # fp32 equivalence: no TF32, the plain (math) attention kernel
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        from torch.nn.attention import SDPBackend, sdpa_kernel
        sdpa_kernel([SDPBackend.MATH]).__enter__()
    cfg = LlamaConfig(**CFG)
    probe = (torch.arange(2 * SEQ).reshape(2, SEQ) * 7 % CFG["vocab_size"]).to(dev)

    def opt(ps):
        return torch.optim.AdamW(ps, lr=LR, weight_decay=0.01)

    def model(seed):
        torch.manual_seed(seed)
        return Llama(cfg)

    # the plain loop: no gpulaunch.parallel, the global batch, this process alone
    ref = model(0).to(dev)
    ref_opt = opt(ref.parameters())
    reference = []
    for step in range(1, STEPS + 1):
        x, y = (t.to(dev) for t in _batch(step, 0, 1))
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=mixed == "bf16"):
            loss = ref(x, y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        reference.append(loss.item())
    del ref, ref_opt

    out = {"reference": reference, "strategies": {}}
    for s in strategies:
        shard = (rank, world) if s != "none" else (0, 1)   # "none": the global batch, alone
        p = gp.prepare(model(0), opt, strategy=s, mixed_precision=mixed)
        losses = []
        for step in range(1, STEPS + 1):
            x, y = (t.to(dev) for t in _batch(step, *shard))
            loss = p.model(x, y)
            p.backward(loss)
            p.step()
            p.zero_grad()
            mean = loss.detach().float().clone()
            if s != "none":
                dist.all_reduce(mean)
                mean /= world
            losses.append(mean.item())
        with torch.no_grad():
            saved_logits = p.model(probe).float().cpu()
        gp.save_checkpoint(f"{root}/{s}", p, step=STEPS)
        q = gp.prepare(model(123), opt, strategy=s, mixed_precision=mixed)
        info = gp.load_checkpoint(f"{root}/{s}", q)
        with torch.no_grad():
            loaded_logits = q.model(probe).float().cpu()
        out["strategies"][s] = {
            "losses": losses, "loaded_step": info["step"], "wrapper": type(p.model).__name__,
            "probe_max_diff": (loaded_logits - saved_logits).abs().max().item(),
            "probe_spread": saved_logits.std().item()}
        del p, q
        if dev.type == "cuda":
            out["strategies"][s]["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
    return out


def _launch(strategies, mixed, tmp_path):
    from gpulaunch import distributed
    # no env=: a TORCH_* variable there would make the ranks spawn instead of fork (+ ~5 s)
    job = distributed(timeout=240, stream_logs="rank0")
    return job(train_every_strategy).distributed(str(tmp_path / "ckpt"), strategies, mixed)


@pytest.mark.timeout(240)
def test_prepare_every_strategy_in_bf16_matches_the_plain_loop_and_round_trips(
        gpu, record, tmp_path):
    require("deepspeed", "deepspeed (built from its sdist by scripts/gpu_wheels.sh)", load=False)
    results = _launch(STRATEGIES, "bf16", tmp_path)
    r = results[0]
    ref = r["reference"]
    assert all(math.isfinite(v) for v in ref) and ref[-1] < ref[0] - MIN_DROP, ref
    record(reference=ref, strategies=r["strategies"])
    problems = []
    for s in STRATEGIES:
        got = r["strategies"][s]
        losses = got["losses"]
        worst = max(abs(a - b) for a, b in zip(losses, ref))
        if not all(math.isfinite(v) for v in losses) or worst > BF16_ATOL:
            problems.append(f"{s}: losses {losses} vs plain loop {ref} (max |diff| {worst:.3g})")
        if not losses[-1] < losses[0] - MIN_DROP:
            problems.append(f"{s}: did not learn: {losses}")
        if got["loaded_step"] != STEPS or got["probe_max_diff"] > PROBE_ATOL:
            problems.append(f"{s}: checkpoint round trip: step {got['loaded_step']}, logits "
                            f"max |diff| {got['probe_max_diff']:.3g} (spread "
                            f"{got['probe_spread']:.3g})")
        if got["wrapper"] != WRAPPERS[s]:
            problems.append(f"{s}: the model is a {got['wrapper']}, not a {WRAPPERS[s]}")
    assert not problems, "\n".join(problems)
    # every rank saw the same global losses
    for other in results[1:]:
        for s in STRATEGIES[1:]:
            assert other["strategies"][s]["losses"] == r["strategies"][s]["losses"], s


@pytest.mark.gpus(2)
@pytest.mark.timeout(240)
def test_world_size_n_matches_the_single_process_loop_in_fp32(gpu, record, tmp_path):
    require("deepspeed", "deepspeed (built from its sdist by scripts/gpu_wheels.sh)", load=False)
    strategies = ["ddp", "fsdp", "zero2"]
    r = _launch(strategies, None, tmp_path)[0]
    ref = r["reference"]
    record(world=gpu.count, reference=ref, strategies=r["strategies"])
    for s in strategies:
        losses = r["strategies"][s]["losses"]
        for step, (a, b) in enumerate(zip(losses, ref), 1):
            assert abs(a - b) <= FP32_RTOL * abs(b), (s, step, losses, ref)
        assert r["strategies"][s]["probe_max_diff"] <= 1e-5, (s, r["strategies"][s])
