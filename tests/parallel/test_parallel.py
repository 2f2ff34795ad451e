"""gpulaunch.parallel on CPU with gloo and 2 real processes: equivalence, checkpoints, export, crashes.

Every multi-process test runs real ranks through gpulaunch's own launcher (CPU workers, gloo
collectives); nothing is mocked. The crash tests make a rank SIGKILL itself at a chosen point of
the save (a test-side patch of the save's internals inside that rank), then check the files.
The reference is plain single-process PyTorch on the concatenated global batch, written here
without gpulaunch, so a strategy that silently does not train (or trains differently) fails.

Tolerance (fp32): losses must agree with the reference to ``ATOL`` = 1e-5 absolute over 20 AdamW
steps (losses go ~4.16 -> ~3.30; measured max deviation 4.8e-7 for every strategy, 2026-12-02). The strategies differ from the reference only in the order of
floating-point sums (gradient all-reduce / reduce-scatter averages two half-batch gradients
instead of one full-batch backward), i.e. ~1e-7 relative per step; Adam can amplify that a little,
and 1e-5 leaves ~20x headroom while a wrong gradient scale (e.g. a sum
instead of a mean, a missed step, a stale optimizer) moves the losses by >1e-2 within a few steps.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from gpulaunch import parallel as gp  # noqa: E402
from gpulaunch.parallel.reference_model import Llama, LlamaConfig  # noqa: E402

try:
    import deepspeed  # noqa: F401

    HAVE_DS = True
except Exception:  # pragma: no cover
    HAVE_DS = False

os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/work/.cache/torch_extensions")

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
WORLD = 2
GLOBAL_BATCH = 4
SEQ = 16
STEPS = 20
SAVE_AT = 10
LR = 3e-3
ATOL = 1e-5
STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]
needs_ds = pytest.mark.skipif(not HAVE_DS, reason="deepspeed not installed (pip install 'gpulaunch[deepspeed]')")


# ----------------------------------------------------------------------------- launching ranks
def run_ranks(fn, *args, world=WORLD):
    """Run ``fn(*args)`` on ``world`` real CPU ranks (gloo) through gpulaunch's own launcher."""
    from gpulaunch import distributed
    from gpulaunch import runtime as rt

    @distributed(gpus=world, stream_logs="none", timeout=300,
                 env={"TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]})
    def job(*a):
        rt.init()
        return fn(*a)

    return job.distributed(*args)


# ----------------------------------------------------------------------------- data and reference
def global_batch(step: int):
    """A learnable batch: each row is an arithmetic progression mod vocab (next = prev + stride)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % CFG.vocab_size
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def local_batch(step: int, rank: int, world: int, parts: int = 1, part: int = 0):
    x, y = global_batch(step)
    n = GLOBAL_BATCH // world
    x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    m = n // parts
    return x[part * m:(part + 1) * m], y[part * m:(part + 1) * m]


PROBE = torch.arange(2 * SEQ).reshape(2, SEQ) % CFG.vocab_size


def make_model(seed=0):
    torch.manual_seed(seed)
    return Llama(CFG)


def opt_factory(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


_REF = {}


def reference_losses(steps=STEPS):
    """Plain single-process PyTorch on the global batch: no gpulaunch involved."""
    if steps not in _REF:
        model = make_model(0)
        opt = opt_factory(model.parameters())
        losses = []
        for step in range(1, steps + 1):
            x, y = global_batch(step)
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():
            probe = model(PROBE)
        _REF[steps] = (losses, probe)
    return _REF[steps]


def _global_mean(t: torch.Tensor) -> float:
    t = t.detach().float().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


# ----------------------------------------------------------------------------- rank jobs
def job_train_save_resume(strategy, root):
    """Uninterrupted 20 steps (saving at 10 and 20), then a fresh run that resumes at 10."""
    rank, world = dist.get_rank(), dist.get_world_size()
    p = gp.prepare(make_model(0), opt_factory, strategy=strategy)
    losses = []
    for step in range(1, STEPS + 1):
        x, y = local_batch(step, rank, world)
        loss = p.model(x, y)
        p.backward(loss)
        p.step()
        p.zero_grad()
        losses.append(_global_mean(loss))
        if step in (SAVE_AT, STEPS):
            gp.save_checkpoint(root, p, step=step, extra={"saved_at": step, "strategy": strategy})
    with torch.no_grad():
        probe = p.model(PROBE).float()

    # a fresh run, from a *different* init, that must resume exactly where step 10 left off
    q = gp.prepare(make_model(seed=123), opt_factory, strategy=strategy)
    info = gp.load_checkpoint(root, q, step=SAVE_AT)
    resumed = []
    for step in range(info["step"] + 1, STEPS + 1):
        x, y = local_batch(step, rank, world)
        loss = q.model(x, y)
        q.backward(loss)
        q.step()
        q.zero_grad()
        resumed.append(_global_mean(loss))
    latest = gp.latest_checkpoint(root)
    return {"losses": losses, "resumed": resumed, "extra": info["extra"], "probe": probe,
            "latest": latest, "type": type(p.model).__name__}


def job_variants():
    """Things that must not change the numbers: accumulation, activation checkpointing, a pre-built
    optimizer under FSDP2 (rebuilt on the sharded parameters), plain loss.backward()/opt.step()."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    steps = 6

    def train(p, parts=1, use_prepared_api=True):
        losses = []
        for step in range(1, steps + 1):
            tot = 0.0
            for part in range(parts):
                x, y = local_batch(step, rank, world, parts, part)
                with p.accumulate():
                    loss = p.model(x, y)
                    if use_prepared_api:
                        p.backward(loss)
                    else:
                        loss.backward()
                tot += _global_mean(loss) / parts
                stepped = p.step() if use_prepared_api else (p.optimizer.step() or True)
                assert stepped == (part == parts - 1) or not use_prepared_api
                if use_prepared_api:
                    p.zero_grad()
                else:
                    p.optimizer.zero_grad()
            losses.append(tot)
        return losses

    for strategy in ["ddp", "fsdp"] + (["zero2"] if HAVE_DS else []):
        out[f"{strategy}_accum2"] = train(gp.prepare(make_model(0), opt_factory, strategy=strategy,
                                                     gradient_accumulation_steps=2), parts=2)
    out["fsdp_ac"] = train(gp.prepare(make_model(0), opt_factory, strategy="fsdp", activation_checkpointing=True))
    out["ddp_ac"] = train(gp.prepare(make_model(0), opt_factory, strategy="ddp", activation_checkpointing=True))
    model = make_model(0)
    built = opt_factory(model.parameters())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = gp.prepare(model, built, strategy="fsdp")
    out["fsdp_prebuilt_warned"] = any("rebuilt on them" in str(x.message) for x in w)
    out["fsdp_prebuilt_is_new"] = p.optimizer is not built
    out["fsdp_prebuilt"] = train(p)
    out["fsdp_plain_api"] = train(gp.prepare(make_model(0), opt_factory, strategy="fsdp"), use_prepared_api=False)
    out["auto_strategy"] = gp.prepare(make_model(0), opt_factory, strategy="auto").strategy
    out["ddp_plain_api"] = train(gp.prepare(make_model(0), opt_factory, strategy="ddp"), use_prepared_api=False)
    # bf16 smoke: trains and stays near fp32 (bf16 tolerance, not equivalence)
    for strategy in ["ddp", "fsdp"] + (["zero3"] if HAVE_DS else []):
        out[f"{strategy}_bf16"] = train(gp.prepare(make_model(0), opt_factory, strategy=strategy,
                                                   mixed_precision="bf16"))
    return out


_CACHE = {}


def strategy_result(strategy, tmp_path_factory):
    if strategy not in _CACHE:
        root = str(tmp_path_factory.mktemp(f"ckpt_{strategy}"))
        res = run_ranks(job_train_save_resume, strategy, root)
        _CACHE[strategy] = (res, root)
    return _CACHE[strategy]


def _params(strategy):
    return [pytest.param(s, marks=needs_ds) if s.startswith("zero") else s for s in STRATEGIES]


# ----------------------------------------------------------------------------- tests: equivalence
def test_reference_trains():
    losses, _ = reference_losses()
    assert losses[-1] < 0.8 * losses[0], losses  # the data is learnable in 20 steps


@pytest.mark.parametrize("strategy", _params(STRATEGIES))
def test_same_losses_as_single_process(strategy, tmp_path_factory):
    (r0, r1), _ = strategy_result(strategy, tmp_path_factory)
    ref, _ = reference_losses()
    assert r0["losses"] == r1["losses"]  # the all-reduced mean is the same on both ranks
    got = r0["losses"]
    assert len(got) == STEPS
    assert got[-1] < 0.8 * got[0], f"{strategy} did not train: {got}"
    diff = max(abs(a - b) for a, b in zip(got, ref))
    assert diff <= ATOL, f"{strategy}: max |loss - reference| = {diff:.3g} > {ATOL} \n{got}\n{ref}"


@pytest.mark.parametrize("strategy", _params(STRATEGIES))
def test_resume_from_step_10_matches_uninterrupted(strategy, tmp_path_factory):
    (r0, _), root = strategy_result(strategy, tmp_path_factory)
    assert r0["extra"] == {"saved_at": SAVE_AT, "strategy": strategy}
    assert len(r0["resumed"]) == STEPS - SAVE_AT
    diff = max(abs(a - b) for a, b in zip(r0["resumed"], r0["losses"][SAVE_AT:]))
    assert diff <= ATOL, f"{strategy}: resumed {r0['resumed']} vs {r0['losses'][SAVE_AT:]}"
    assert r0["latest"].endswith("step_00000020")
    assert [s for s, _ in gp.list_checkpoints(root)] == [SAVE_AT, STEPS]


@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("zero3", marks=needs_ds),
                                      pytest.param("zero1", marks=needs_ds), "ddp"])
def test_export_loads_into_plain_module(strategy, tmp_path_factory, tmp_path):
    (r0, _), root = strategy_result(strategy, tmp_path_factory)
    out = tmp_path / "model.safetensors"
    sd = gp.export(root, str(out))  # newest checkpoint: step 20
    from safetensors.torch import load_file

    plain = Llama(CFG)
    plain.load_state_dict(load_file(str(out)), strict=True)
    assert set(sd) == set(plain.state_dict())
    with torch.no_grad():
        got = plain(PROBE)
    torch.testing.assert_close(got, r0["probe"], rtol=0, atol=1e-5)
    _, ref_probe = reference_losses()
    torch.testing.assert_close(got, ref_probe, rtol=0, atol=1e-3)  # and it is the trained model
    # torch.save format too, from the step-10 checkpoint
    sd10 = gp.export(root, str(tmp_path / "m10.pt"), step=SAVE_AT)
    assert not all(torch.equal(sd10[k], sd[k]) for k in sd)


@pytest.mark.slow
def test_variants_match_reference():
    res = run_ranks(job_variants)[0]
    ref, _ = reference_losses()
    ref = ref[:6]
    for key, losses in res.items():
        if key.endswith("_bf16"):
            assert max(abs(a - b) for a, b in zip(losses, ref)) < 0.05, (key, losses, ref)
            assert losses[-1] < losses[0], key
        elif isinstance(losses, list):
            diff = max(abs(a - b) for a, b in zip(losses, ref))
            assert diff <= ATOL, (key, diff, losses, ref)
    assert res["fsdp_prebuilt_warned"] and res["fsdp_prebuilt_is_new"]
    assert res["auto_strategy"] in ("ddp", "fsdp", "zero1", "zero2", "zero3")


# ----------------------------------------------------------------------------- tests: crashes
def job_crash_during_save(strategy, root, where, probe_dir):
    """Save step 1, train, then die (SIGKILL) in the middle of saving step 2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    p = gp.prepare(make_model(0), opt_factory, strategy=strategy)

    def one_step(step):
        x, y = local_batch(step, rank, world)
        p.backward(p.model(x, y))
        p.step()
        p.zero_grad()

    one_step(1)
    gp.save_checkpoint(root, p, step=1, extra="one")
    with torch.no_grad():
        torch.save(p.model(PROBE).float(), os.path.join(probe_dir, f"probe_step1_rank{rank}.pt"))
    one_step(2)
    from gpulaunch.parallel import checkpoint as ck

    if where == "mid_write" and rank == 1:  # rank 1 dies after writing part of its payload
        orig = ck._write_payload

        def write_then_die(pp, d):
            orig(pp, d)
            os.kill(os.getpid(), signal.SIGKILL)

        ck._write_payload = write_then_die
    if where == "publish" and rank == 0:  # everything written; rank 0 dies while publishing
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)

        ck._publish = die
    gp.save_checkpoint(root, p, step=2, extra="two")
    return "saved"  # not reached


def job_load_after_crash(strategy, root, probe_dir):
    rank = dist.get_rank()
    p = gp.prepare(make_model(seed=7), opt_factory, strategy=strategy)
    info = gp.load_checkpoint(root, p)
    with torch.no_grad():
        probe = p.model(PROBE).float()
    expect = torch.load(os.path.join(probe_dir, f"probe_step1_rank{rank}.pt"))
    torch.testing.assert_close(probe, expect, rtol=0, atol=0)
    # a later save still works and becomes the newest
    gp.save_checkpoint(root, p, step=3)
    return info["step"], info["extra"], gp.latest_checkpoint(root)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,where,url", [
    ("fsdp", "mid_write", False),
    ("fsdp", "publish", False),
    ("ddp", "publish", True),  # fsspec URL: no rename, completion marker decides
    pytest.param("zero3", "mid_write", False, marks=needs_ds),
])
def test_killed_while_saving_leaves_previous_checkpoint(strategy, where, url, tmp_path):
    from gpulaunch.errors import WorkerCrashError

    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    ckpt_root = f"file://{root}" if url else root
    with pytest.raises(WorkerCrashError, match="killed by SIGKILL"):
        run_ranks(job_crash_during_save, strategy, ckpt_root, where, str(tmp_path))
    # the half-written step 2 exists on disk but does not count
    leftovers = [n for n in os.listdir(root) if "step_00000002" in n]
    assert leftovers, "the crash happened before anything of step 2 was written: test is not testing"
    assert gp.latest_checkpoint(ckpt_root).endswith("step_00000001")
    assert [s for s, _ in gp.list_checkpoints(ckpt_root)] == [1]
    res = run_ranks(job_load_after_crash, strategy, ckpt_root, str(tmp_path))
    assert res[0][:2] == (1, "one")
    assert res[0][2].endswith("step_00000003")
    if not url:
        assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]  # stale temp cleaned


# ----------------------------------------------------------------------------- tests: errors
def test_bad_inputs_fail_early_with_the_fix():
    m = make_model()
    with pytest.raises(gp.ParallelError, match="unknown strategy 'zero4'.*ddp"):
        gp.prepare(m, opt_factory, strategy="zero4")
    with pytest.raises(gp.ParallelError, match="fp16 on CPU.*bf16"):
        gp.prepare(m, opt_factory, strategy="zero2", mixed_precision="fp16", device="cpu")
    with pytest.raises(gp.ParallelError, match="torch.optim.Optimizer or a factory"):
        gp.prepare(m, optimizer=0.1, strategy="none")
    with pytest.raises(gp.ParallelError, match="not this model's"):
        gp.prepare(m, optimizer=opt_factory(make_model().parameters()), strategy="none")
    with pytest.raises(gp.ParallelError, match="process group.*runtime.init"):
        gp.prepare(m, opt_factory, strategy="fsdp")
    with pytest.raises(gp.ParallelError, match="mixed_precision"):
        gp.prepare(m, opt_factory, strategy="none", mixed_precision="int8")
    with pytest.raises(gp.ParallelError, match="blocks=.*matched no submodule"):
        gp.find_blocks(m, "NoSuchLayer")
    with pytest.raises(gp.ParallelError, match="factory"):
        gp.prepare(m, opt_factory, strategy="none", lr_scheduler=torch.optim.lr_scheduler.StepLR(
            opt_factory(m.parameters()), 1))
    with pytest.raises(FileNotFoundError):
        gp.load_checkpoint("/nonexistent/ckpts", gp.prepare(make_model(), opt_factory, strategy="none"))


def test_block_detection():
    m = make_model()
    assert gp.find_blocks(m) == list(m.layers)
    assert gp.find_blocks(m, "Block") == list(m.layers)
    assert gp.find_blocks(m, lambda mod: type(mod).__name__ == "MLP") == [b.mlp for b in m.layers]


def test_auto_chooses_by_memory_through_the_planner(monkeypatch):
    """strategy='auto' asks the planner (ours, always importable: no silent fallback): replicate
    when the training state fits each device, shard when it does not, and no wrapper at all on
    one rank. A 1.07 B-parameter model on the meta device (the planner reads shapes only)."""
    from gpulaunch.parallel import strategies as prep_mod

    m = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192, device="meta") for _ in range(16)])
    need = gp.estimate_training_bytes(m)
    assert need == 16 * sum(p.numel() for p in m.parameters())  # fp32 param + grad + 2 Adam states
    gib = 2 ** 30
    monkeypatch.setenv("WORLD_SIZE", "2")   # (no process group here: the world size is the env's)
    monkeypatch.setattr(prep_mod, "_device_memory", lambda device: 80 * gib)
    s, why = prep_mod._choose_auto(m, torch.device("cpu"), None)
    assert s == "ddp" and why.startswith("planner: ddp fits")
    monkeypatch.setattr(prep_mod, "_device_memory", lambda device: 16 * gib)
    s, why = prep_mod._choose_auto(m, torch.device("cpu"), None)
    assert s == "fsdp" and "fsdp fits" in why and "ddp needs" in why
    # one rank: nothing to replicate to or shard across, whether it fits or not
    monkeypatch.setenv("WORLD_SIZE", "1")
    for have in (80 * gib, 30 * gib):
        monkeypatch.setattr(prep_mod, "_device_memory", lambda device, have=have: have)
        s, why = prep_mod._choose_auto(m, torch.device("cpu"), None)
        assert s == "none" and "world size 1" in why


def test_none_strategy_single_process_checkpoint_roundtrip(tmp_path):
    """strategy='none' (no process group): save, reload into a fresh model, same weights + optimizer,
    with gradient accumulation, an lr scheduler and fp32."""
    def mk(seed):
        return gp.prepare(make_model(seed), opt_factory, strategy="none", gradient_accumulation_steps=2,
                          lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5))
    p = mk(0)
    for step in range(1, 4):
        for part in range(2):
            x, y = local_batch(step, 0, 1, 2, part)
            with p.accumulate():
                p.backward(p.model(x, y))
            p.step()
            p.zero_grad()
    gp.save_checkpoint(tmp_path, p, step=3, extra=[1, 2])
    q = mk(5)
    assert gp.load_checkpoint(tmp_path, q)["extra"] == [1, 2]
    for a, b in zip(p.model.parameters(), q.model.parameters()):
        assert torch.equal(a, b)
    assert q.lr_scheduler.get_last_lr() == p.lr_scheduler.get_last_lr() != [LR]
    sp, sq = p.optimizer.state_dict(), q.optimizer.state_dict()
    for k in sp["state"]:
        assert torch.equal(sp["state"][k]["exp_avg"], sq["state"][k]["exp_avg"])


def job_load_as(strategy, root, step):
    p = gp.prepare(make_model(seed=99), opt_factory, strategy=strategy)
    info = gp.load_checkpoint(root, p, step=step)
    with torch.no_grad():
        return info["step"], p.model(PROBE).float()


def test_dcp_checkpoints_move_between_ddp_fsdp_and_world_sizes(tmp_path_factory):
    """A DDP checkpoint resumes under FSDP2 (2 ranks), and an FSDP2 one in a single process."""
    (ddp0, _), ddp_root = strategy_result("ddp", tmp_path_factory)
    (fsdp0, _), fsdp_root = strategy_result("fsdp", tmp_path_factory)
    step, probe = run_ranks(job_load_as, "fsdp", ddp_root, STEPS)[0]
    assert step == STEPS
    torch.testing.assert_close(probe, ddp0["probe"], rtol=0, atol=1e-6)
    p = gp.prepare(make_model(seed=99), opt_factory, strategy="none")
    assert gp.load_checkpoint(fsdp_root, p)["step"] == STEPS
    with torch.no_grad():
        torch.testing.assert_close(p.model(PROBE), fsdp0["probe"], rtol=0, atol=1e-6)
    if HAVE_DS:  # a ZeRO checkpoint is DeepSpeed's format: a clear error that names export()
        (_, _), z_root = strategy_result("zero2", tmp_path_factory)
        with pytest.raises(gp.ParallelError, match="export"):
            gp.load_checkpoint(z_root, gp.prepare(make_model(), opt_factory, strategy="none"))
