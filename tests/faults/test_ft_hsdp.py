"""HSDP under torchft: replica groups of several ranks that shard the model with FSDP2 inside
the group and replicate it across groups through torchft (``run_replicas(ranks_per_group=2)``,
``ft.replicated(..., shard=True)``). Real lighthouse, real launches, real gloo, a real SIGKILL
of ONE rank of a group from outside; plus the early refusals and the pure parts (no processes).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import alive

torchft = pytest.importorskip("torchft")

import torch  # noqa: E402
from test_ft_replicas import _batch, _eval_loss, _model, _monotonic, _no_process_left  # noqa: E402

from gpulaunch import ft  # noqa: E402
from gpulaunch.errors import ConfigurationError  # noqa: E402
from gpulaunch.ft.options import check_options  # noqa: E402
from gpulaunch.ft.result import read_steps  # noqa: E402
from gpulaunch.ft.sharded import check_layout, rebind_optimizer  # noqa: E402

STEPS = 40
LR = 0.05
GROUPS, RANKS = 2, 2


def _full_weights(model):
    """Every parameter unsharded (an all-gather inside the group: every rank calls it)."""
    from torch.distributed.tensor import DTensor
    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten()
                      for p in model.parameters()])


def _train_hsdp(steps: int, pause: float, use_prepare: bool = False):
    import time

    import torch
    import torch.distributed as dist

    from gpulaunch import ft
    model = _model()
    if use_prepare:
        from gpulaunch.parallel import prepare
        p = prepare(model, lambda ps: torch.optim.Adam(ps, lr=LR), fault_tolerant=True,
                    strategy="fsdp")
        while p.committed_step < steps:
            x, y = _batch(p.committed_step, p.data_rank)
            p.backward(torch.nn.functional.mse_loss(p.model(x), y))
            p.step()
            p.zero_grad()
            time.sleep(pause)
        r, inner = p.replicated, p.unwrap()
    else:
        # a built optimizer: ft.replicated rebinds it to the sharded parameters
        r = ft.replicated(model, torch.optim.Adam(model.parameters(), lr=LR), shard=True)
        while r.step < steps:
            r.optimizer.zero_grad()
            x, y = _batch(r.step, r.data_rank)      # each rank of each group: its own batch
            torch.nn.functional.mse_loss(r.model(x), y).backward()
            r.optimizer.step()
            time.sleep(pause)
        inner = r.model.module
    out = r.summary()
    out["group_rank"] = dist.get_rank()
    out["data"] = (r.data_rank, r.data_size)
    out["weights"] = _full_weights(inner)
    out["eval_loss"] = _eval_loss(inner)
    r.shutdown()
    return out


def _failure_free_loss(steps: int, data_size: int) -> float:
    """The same training in one process: a step's gradient is the mean over every rank's
    batch of every group (FSDP2 averages within a group, torchft across groups)."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        for i in range(data_size):
            x, y = _batch(step, i)
            (torch.nn.functional.mse_loss(model(x), y) / data_size).backward()
        opt.step()
    return _eval_loss(model)


def _rank_pid(ft_dir, replica: int, attempt: int, rank: int) -> int:
    return int((ft_dir / f"replica{replica}.attempt{attempt}.rank{rank}.pid").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0-the-lighthouse-client"])
def test_one_rank_sigkilled_replaces_its_whole_group_which_heals_shard_by_shard(
        tmp_path, gpulaunch_home, victim):
    """Any rank of a group: rank 1, or rank 0 (the one whose torchft ManagerServer talks to the
    lighthouse and gathers the group's quorum and commit votes)."""
    killed = {}
    lighthouse_pids = []
    ft_dir = tmp_path / "ft"

    def kill_one_rank_of_group_1(groups):
        lighthouse_pids[:] = [groups.lighthouse.pid]
        if killed:
            return
        mine = read_steps(groups.ft_dir, 1)
        if mine and mine[-1]["step"] >= 12:
            group = ft.group_pids(groups.ft_dir, 1, 0)
            pid = _rank_pid(ft_dir, 1, 0, victim)
            os.kill(pid, signal.SIGKILL)        # one rank of the group, mid-step
            killed.update(step=mine[-1]["step"], t=time.time(), group=group)

    result = ft.run_replicas(_train_hsdp, STEPS, 0.05, replicas=GROUPS, ranks_per_group=RANKS,
                             max_group_restarts=2, ft_dir=str(ft_dir),
                             on_poll=kill_one_rank_of_group_1)

    assert killed, "the run ended before replica 1 reached step 12"
    assert len(killed["group"]) == RANKS
    # the group failed once, as a unit, and was replaced
    assert [(f.replica, f.attempt, f.restarted) for f in result.failures] == [(1, 0, True)]
    failure = result.failures[0]
    assert failure.healed_to is not None and failure.healed_to >= killed["step"]
    # every rank of the replaced group is a new process (the survivor rank was stopped too)
    assert not alive(killed["group"])
    assert not set(ft.group_pids(ft_dir, 1, 1)) & set(killed["group"])
    # the survivor never went back and never restarted
    survivor = result.steps[0]
    assert {r["a"] for r in survivor} == {0} and _monotonic(survivor)
    assert survivor[-1]["step"] == STEPS
    again = [r for r in result.steps[1] if r["a"] == 1]
    assert again[0].get("healed_to") == again[0]["step"] - 1 >= killed["step"]
    # both ranks of both groups: the run's step, the data layout, full weights bit-equal
    for replica in range(GROUPS):
        ranks = result.results[replica]
        assert [r["group_rank"] for r in ranks] == list(range(RANKS))
        assert [r["data"] for r in ranks] == [(replica * RANKS + k, GROUPS * RANKS)
                                               for k in range(RANKS)]
        assert all(r["step"] == STEPS for r in ranks)
    assert all(r["attempt"] == 1 for r in result.results[1])
    w = result.results[0][0]["weights"]
    for replica in range(GROUPS):
        for r in result.results[replica]:
            assert torch.equal(r["weights"], w), (replica, r["group_rank"])
    reference = _failure_free_loss(STEPS, GROUPS * RANKS)
    loss = result.results[0][0]["eval_loss"]
    assert abs(loss - reference) <= 0.02, (loss, reference)
    _no_process_left(ft_dir, gpulaunch_home, lighthouse_pids)
    assert not result.given_up


def _grads(model, ids, step):
    model.zero_grad()
    for i in ids:
        x, y = _batch(step, i)
        (torch.nn.functional.mse_loss(model(x), y) / len(ids)).backward()
    return [p.grad.clone() for p in model.parameters()]


def _one_process_weights(steps: int):
    """What 2 groups x 2 ranks of HSDP under torchft compute, in one process.

    Every step after the first: the mean gradient of the four ranks' batches. The first step is
    torchft's ``init_sync``: at step 0 every group rank k heals from group ``k % groups`` (torchft
    spreads the healing sources over the group ranks), and a healing rank's gradient counts as
    zero in the average over 2 groups. So shard 0 (the first half of each parameter's rows,
    FSDP2's dim-0 split) steps with group 0's gradient / 2, shard 1 with group 1's / 2."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        if step == 0:
            by_group = [_grads(model, [g * RANKS + k for k in range(RANKS)], 0)
                        for g in range(GROUPS)]
            for i, p in enumerate(model.parameters()):
                rows = -(-p.shape[0] // RANKS)
                p.grad = torch.cat([by_group[k % GROUPS][i][k * rows:(k + 1) * rows] / GROUPS
                                    for k in range(RANKS)])
        else:
            _grads(model, range(GROUPS * RANKS), step)
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.slow
@pytest.mark.parametrize("use_prepare", [False, True], ids=["replicated", "prepare"])
def test_hsdp_computes_what_one_process_computes(tmp_path, gpulaunch_home, use_prepare):
    """No failure: ft.replicated(shard=True) and prepare(strategy='fsdp', fault_tolerant=True)
    over 2 groups x 2 ranks end with the weights one process computes (float summation order
    aside): FSDP2 averages within a group, torchft across groups, shard by shard."""
    steps = 12
    result = ft.run_replicas(_train_hsdp, steps, 0.0, use_prepare, replicas=GROUPS,
                             ranks_per_group=RANKS, ft_dir=str(tmp_path / "ft"))
    assert not result.failures
    w = result.results[0][0]["weights"]
    for replica in range(GROUPS):
        for r in result.results[replica]:
            assert torch.equal(r["weights"], w)
            assert r["step"] == steps and r["committed_steps"] == steps
    if all(rec["n"] == GROUPS for recs in result.steps.values() for rec in recs):
        assert (w - _one_process_weights(steps)).abs().max() <= 1e-6
    else:
        # a group that came up late took a first step alone (torchft's quorum did not wait)
        assert abs(result.results[0][0]["eval_loss"]
                   - _failure_free_loss(steps, GROUPS * RANKS)) <= 0.02


def _train_hsdp_accumulating(steps: int):
    import torch

    from gpulaunch.parallel import prepare
    model = _model()
    p = prepare(model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="fsdp",
                gradient_accumulation_steps=2, max_grad_norm=0.05,
                lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 5, 0.5),
                fault_tolerant=True)
    while p.committed_step < steps:
        for micro in range(2):
            with p.accumulate():            # FSDP2: no reduce-scatter, no cross-group all-reduce
                x, y = _batch(p.committed_step, 2 * p.data_rank + micro)
                p.backward(torch.nn.functional.mse_loss(p.model(x), y))
            p.step()
            p.zero_grad()
    out = p.summary()
    out["lr"] = p.optimizer.param_groups[0]["lr"]
    out["weights"] = _full_weights(p.unwrap())
    out["eval_loss"] = _eval_loss(p.unwrap())
    p.shutdown()
    return out


@pytest.mark.slow
def test_hsdp_accumulation_clipping_and_scheduler(tmp_path, gpulaunch_home):
    steps = 20
    result = ft.run_replicas(_train_hsdp_accumulating, steps, replicas=GROUPS,
                             ranks_per_group=RANKS, ft_dir=str(tmp_path / "ft"))
    assert not result.failures
    w = result.results[0][0]["weights"]
    for replica in range(GROUPS):
        for r in result.results[replica]:
            assert r["step"] == steps and r["committed_steps"] == steps
            assert r["lr"] == pytest.approx(0.1 * 0.5 ** 4)
            assert torch.equal(r["weights"], w)

    def reference(clip):
        """One process: 8 micro-batches per step (2 ranks x 2 groups x 2), clipped, scheduled."""
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)
        for step in range(steps):
            _grads(model, range(2 * GROUPS * RANKS), step)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
        return _eval_loss(model)

    # (torchft's first step differs from the one-process one a little, as above; clipping at
    # 0.05 moves the loss by far more than that)
    loss = result.results[0][0]["eval_loss"]
    assert abs(loss - reference(0.05)) <= 0.02, (loss, reference(0.05))
    assert abs(loss - reference(None)) > 0.1


# ------------------------------------------------------------------ pure parts, no processes
@pytest.mark.unit
@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_ranks_per_group_must_be_a_positive_int(bad):
    with pytest.raises(ConfigurationError, match="ranks_per_group must be an int >= 1"):
        ft.run_replicas(_train_hsdp, 1, 0.0, replicas=2, ranks_per_group=bad)


@pytest.mark.unit
def test_gpus_per_replica_is_the_older_name_of_ranks_per_group():
    base = dict(replicas=2, max_group_restarts=1, spares=1, launch_options={})
    assert check_options(ranks_per_group=1, gpus_per_replica=1, **base) == 1
    assert check_options(ranks_per_group=1, gpus_per_replica=4, **base) == 4
    assert check_options(ranks_per_group=4, gpus_per_replica=4, **base) == 4
    with pytest.raises(ConfigurationError, match="give one of them"):
        check_options(ranks_per_group=2, gpus_per_replica=4, **base)
    with pytest.raises(ConfigurationError, match="gpus=.*ranks_per_group"):
        check_options(ranks_per_group=2, gpus_per_replica=1, **{**base, "launch_options":
                                                               {"gpus": 2}})


@pytest.mark.unit
def test_a_group_of_several_ranks_must_shard():
    check_layout(1, False)
    check_layout(1, True)                  # one rank: FSDP2 over one rank, allowed
    check_layout(2, True)
    with pytest.raises(ConfigurationError, match="has 2 ranks: pass ft.replicated.*shard=True"):
        check_layout(2, False)


@pytest.mark.unit
def test_a_built_optimizer_is_rebound_to_the_sharded_parameters():
    before = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    after = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.Adam([{"params": [before[1]], "lr": 0.1}, {"params": [before[0]]}])
    rebind_optimizer(opt, before, after)
    assert opt.param_groups[0]["params"][0] is after[1]
    assert opt.param_groups[1]["params"][0] is after[0]
    assert opt.param_groups[0]["lr"] == 0.1
    # an optimizer that has stepped holds state for the unsharded tensors: refused
    stepped = torch.optim.Adam(before)
    before[0].grad = torch.ones(2)
    stepped.step()
    with pytest.raises(ConfigurationError, match="has not stepped yet"):
        rebind_optimizer(stepped, before, after)
    foreign = torch.optim.Adam([torch.nn.Parameter(torch.ones(1))])
    with pytest.raises(ConfigurationError, match="not the model's"):
        rebind_optimizer(foreign, before, after)


@pytest.mark.unit
def test_prepare_auto_shards_only_in_a_group_of_several_ranks(monkeypatch):
    from gpulaunch.parallel.fault_tolerant import _shards
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not _shards("auto") and _shards("fsdp") and not _shards("ddp")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _shards("auto") and _shards("fsdp") and not _shards("ddp")
