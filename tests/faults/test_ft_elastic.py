"""Elastic size for replica groups (gpulaunch.ft, ``replicas=(min, max)``): real lighthouse, real
replica-group launches, real gloo, a real SIGKILL from outside; the simulated node's capacity is
a real ``ft.Capacity`` the supervisor polls.

Two groups; one simulated node is taken away (its capacity removed, its process SIGKILLed): the
survivor keeps stepping on one group (its step never goes back), doing both data shards per step
(the global batch kept); the capacity returns and a second group joins, heals from the survivor,
and the two end with bit-equal weights; the result records 2 -> 1 -> 2. Below min, the run stops
with ReplicasBelowMinError within node_lost_timeout instead of waiting on a quorum forever.
The policy and the settings are checked without processes (``unit``).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import alive, run_pids

from gpulaunch.errors import ConfigurationError
from gpulaunch.ft.elastic import Capacity, Slot, decide, parse_replicas, shards_for

LR = 0.05


# ------------------------------------------------------------------------------- pure logic

def _d(slots, **kw):
    args = dict(now=100.0, capacity=2, min_size=1, node_lost_timeout=5.0, ending=False,
                committed=True)
    args.update(kw)
    return decide(slots, **args)


@pytest.mark.unit
def test_policy_replaces_within_capacity_waits_then_shrinks_then_grows():
    running, waiting = Slot(0, "running"), Slot(1, "waiting", since=98.0)
    # capacity for it: replaced at once (no size change)
    assert _d([running, waiting]).start == (1,)
    # no capacity, within node_lost_timeout: wait
    d = _d([running, waiting], capacity=1)
    assert d.start == () and d.lose == () and d.fail is None
    # no capacity past node_lost_timeout: lost, the run goes on smaller
    d = _d([running, waiting], capacity=1, now=103.0)
    assert d.lose == (1,) and d.fail is None
    # restart budget spent: lost at once, whatever the capacity
    assert _d([running, Slot(1, "waiting", 99.9, can_start=False)]).lose == (1,)
    # capacity back: a lost group is started again (the run grows)
    assert _d([running, Slot(1, "lost")]).start == (1,)
    assert _d([running, Slot(1, "lost")], capacity=1).start == ()
    # the oldest failure first, waiting before lost, never more than the capacity allows
    slots = [Slot(0, "running"), Slot(1, "lost"), Slot(2, "waiting", 99.0),
             Slot(3, "waiting", 97.0)]
    assert _d(slots, capacity=3).start == (3, 2)
    assert _d(slots, capacity=4).start == (3, 2, 1)


@pytest.mark.unit
def test_policy_stops_below_min_and_when_nobody_is_left_to_heal_from():
    # min 2, one running, one waiting: wait for the capacity ...
    slots = [Slot(0, "running"), Slot(1, "waiting", since=98.0)]
    assert _d(slots, capacity=1, min_size=2).fail is None
    # ... and stop once node_lost_timeout has passed without it
    d = _d(slots, capacity=1, min_size=2, now=110.0)
    assert d.lose == (1,) and "fewer than min=2" in d.fail and "node_lost_timeout=5" in d.fail
    # every group gone after steps were committed: nobody to heal from, no waiting
    d = _d([Slot(0, "waiting", 99.0), Slot(1, "lost")], capacity=2)
    assert "none is left to take the current weights" in d.fail
    # before any commit there is nothing to heal: start again
    assert _d([Slot(0, "waiting", 99.0), Slot(1, "lost")], committed=False).start == (0, 1)
    # a run that is ending (a group finished) starts nothing and never fails on size
    assert _d([Slot(0, "done"), Slot(1, "waiting", 0.0)], ending=True, now=1e9).start == ()


@pytest.mark.unit
def test_capacity_in_memory_and_in_a_file(tmp_path):
    cap = Capacity(2)
    assert cap.available() == 2 and cap.take() == 1 and cap.give(2) == 3 and cap() == 3
    assert cap.take(5) == 0
    with pytest.raises(ConfigurationError, match="int >= 0"):
        Capacity(-1)
    path = tmp_path / "capacity"
    fcap = Capacity.file(path, default=1)
    assert fcap.available() == 1                  # no file yet: the default
    path.write_text("3\n")
    assert fcap.available() == 3
    path.write_text("")                           # half-written: the last value stands
    assert fcap.available() == 3
    fcap.set(2)
    assert path.read_text() == "2\n" and Capacity.file(path).available() == 2


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, match", [
    ({"replicas": (2, 1)}, r"min \(2\) is above max \(1\); write replicas=\(1, 2\)"),
    ({"replicas": (0, 2)}, "min must be >= 1"),
    ({"replicas": (2, 2)}, "min equals max.*pass replicas=2"),
    ({"replicas": (1, 2, 3)}, r"pair of ints \(min, max\)"),
    ({"replicas": (1.0, 2)}, "pair of ints"),
    ({"replicas": (1, 2), "spares": 2}, "at most max - 1 = 1 can ever be used; pass spares=1"),
    ({"replicas": (1, 2), "node_lost_timeout": -1}, "node_lost_timeout must be"),
    ({"replicas": 2, "node_lost_timeout": 5}, r"elastic run: pass replicas=\(min, max\)"),
    ({"replicas": 2, "capacity": 2}, "capacity=.*elastic run"),
    ({"replicas": (1, 2), "capacity": "two"}, "give a gpulaunch.ft.Capacity"),
])
def test_bad_elastic_settings_are_refused_before_anything_starts(kwargs, match):
    from gpulaunch import ft

    def train():
        return 0
    with pytest.raises(ConfigurationError, match=match):
        ft.run_replicas(train, **kwargs)


@pytest.mark.unit
def test_a_run_whose_groups_all_wait_for_capacity_is_not_over_until_node_lost_timeout(tmp_path):
    """The supervisor's own bookkeeping, no process: every group failed before the first
    commit and none may start (capacity 0). poll() keeps the run going while they may still
    come back, then stops it below min, with the size change recorded."""
    from gpulaunch import ft
    from gpulaunch.ft.replicas import ReplicaGroups

    def train():
        return 0
    groups = ReplicaGroups(train, replicas=(1, 2), capacity=ft.Capacity(0),
                           node_lost_timeout=0.3, ft_dir=str(tmp_path))
    groups._state = {0: "waiting", 1: "waiting"}
    groups._since = {0: time.monotonic(), 1: time.monotonic()}
    groups._launched = {0, 1}
    groups.size = 2
    assert groups.poll() is False
    time.sleep(0.35)
    with pytest.raises(ft.ReplicasBelowMinError, match="0 replica group.*fewer than min=1"):
        groups.poll()
    assert [(c.from_size, c.to_size) for c in groups.size_changes] == [(2, 1), (1, 0)]


@pytest.mark.unit
def test_shards_cover_the_global_batch_once_whatever_the_live_groups():
    for total in (2, 3, 4, 7):
        for n in range(1, total + 1):
            got = [shards_for(rank, n, total) for rank in range(n)]
            assert sorted(sum(got, [])) == list(range(total)) and all(got), (total, n)
    assert shards_for(0, 1, 2) == [0, 1] and shards_for(1, 2, 2) == [1]
    assert shards_for(None, 1, 2) == [0, 1]          # healing: rank 0's, gradient zeroed
    assert shards_for(1, 2, 2, first=True) == [0, 1]   # the run's first step: all, on all
    with pytest.raises(ConfigurationError, match="every group needs at least one"):
        shards_for(1, 2, 1)


@pytest.mark.unit
def test_parse_replicas_defaults():
    assert parse_replicas(3) is None
    size = parse_replicas((1, 3))
    assert (size.min, size.max, size.node_lost_timeout) == (1, 3, 60.0)
    assert parse_replicas([1, 3]) == size


# ---------------------------------------------------------------------------- real processes

def _batch(step: int, shard: int):
    import torch
    g = torch.Generator().manual_seed(1000 * step + shard)
    x = torch.randn(16, 8, generator=g)
    return x, torch.tanh(x @ torch.linspace(-1, 1, 8).unsqueeze(1))


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _eval_loss(model) -> float:
    import torch
    x, y = _batch(10**6, 0)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def _last_step(steps: int, until: str | None) -> int:
    """``steps``; with ``until`` (a file the test writes once what it waits for happened), the
    step written there, and no end before it appears (a loaded host can take longer to bring a
    group up than a fixed run of steps lasts). Every group reads the same number: they end
    together."""
    if until is None:
        return steps
    try:
        return max(steps, int(open(until).read()))
    except (FileNotFoundError, ValueError):
        return 3000                              # not yet: the test's own bound


def _train(steps: int, pause: float, shards: int, until: str | None = None):
    """Every step trains on ``shards`` data shards in all, whatever the live groups."""
    import time

    import torch

    from gpulaunch import ft
    model = _model()
    r = ft.replicated(model, torch.optim.Adam(model.parameters(), lr=LR))
    seen = {}                                   # participants -> shards this group trained on
    while r.step < _last_step(steps, until):
        r.optimizer.zero_grad()
        mine = []
        for shard in r.accumulate(shards):
            x, y = _batch(r.step, shard)
            (torch.nn.functional.mse_loss(r.model(x), y) * r.shard_weight(shards)).backward()
            mine.append(shard)
        if r.optimizer.step():       # the run's first step apart: every group trains all
            seen.setdefault(r.participants if r.step > 1 else "first", set()).update(mine)
        time.sleep(pause)
    out = r.summary()
    out["weights"] = torch.cat([p.detach().flatten() for p in model.parameters()])
    out["eval_loss"] = _eval_loss(model)
    out["seen"] = {n: sorted(s) for n, s in seen.items()}
    r.shutdown()
    return out


def _failure_free_loss(steps: int, shards: int) -> float:
    import torch
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        for i in range(shards):
            x, y = _batch(step, i)
            (torch.nn.functional.mse_loss(model(x), y) / shards).backward()
        opt.step()
    return _eval_loss(model)


def _no_process_left(ft_dir, home, lighthouse_pids):
    pids = set(lighthouse_pids)
    for run in (home / "runs").iterdir():
        pids |= run_pids(run)
    pids |= {int(p.read_text()) for p in ft_dir.glob("*.pid")}
    assert len(pids) > len(lighthouse_pids)
    deadline = time.monotonic() + 10
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids), f"processes of the run survived: {alive(pids)}"


def _monotonic(records) -> bool:
    steps = [r["step"] for r in records]
    return all(b > a for a, b in zip(steps, steps[1:]))


STEPS = 90


@pytest.mark.slow
def test_elastic_run_loses_a_node_continues_on_one_and_grows_back_to_two(tmp_path,
                                                                          gpulaunch_home):
    pytest.importorskip("torchft")
    import torch

    from gpulaunch import ft
    from gpulaunch.ft.result import read_steps
    capacity = ft.Capacity(2)                   # two simulated nodes, one replica group each
    ev = {}
    lighthouse_pids = set()

    def node_watcher(groups):
        lighthouse_pids.add(groups.lighthouse.pid)
        mine = read_steps(groups.ft_dir, 0)
        step = mine[-1]["step"] if mine else 0
        if "lost" not in ev and step >= 15:
            capacity.take()                     # node 1 is gone ...
            pids = ft.group_pids(groups.ft_dir, 1, 0)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)    # ... and its processes with it
            ev.update(lost=step, pids=pids)
        elif "lost" in ev and "back" not in ev and groups.size_changes \
                and step >= groups.size_changes[0].step + 10:
            ev["back"] = step                   # 10 steps on one group: the node returns
            capacity.give()

    result = ft.run_replicas(_train, STEPS, 0.03, 2, replicas=(1, 2), node_lost_timeout=1.0,
                             capacity=capacity, ft_dir=str(tmp_path / "ft"),
                             on_poll=node_watcher)

    assert "back" in ev, f"the run ended before the node came back: {ev}, {result.summary()}"
    # the size went 2 -> 1 -> 2, with the step and the group of each change
    changes = [(c.from_size, c.to_size, c.replica) for c in result.size_changes]
    assert changes == [(2, 1, 1), (1, 2, 1)], result.summary()
    shrink, grow = result.size_changes
    assert ev["lost"] <= shrink.step < grow.step and shrink.at < grow.at
    assert "node_lost_timeout=1" in shrink.reason and "joined, healed to" in grow.reason
    # the survivor never went back and never restarted; it stepped on alone in between
    survivor = result.steps[0]
    assert {r["a"] for r in survivor} == {0} and _monotonic(survivor)
    assert survivor[-1]["step"] == STEPS
    alone = [r["step"] for r in survivor if shrink.step <= r["step"] < grow.step]
    assert len(alone) >= 10 and all(r["n"] == 1 for r in survivor
                                    if shrink.step < r["step"] < grow.step)
    # alone, it trained on both shards of each step: the global batch was kept
    out0 = result.results[0][0]
    assert out0["seen"][1] == [0, 1] and len(out0["seen"][2]) == 1   # with 2: one shard each
    # at the first step torchft counts one group's gradient only (it heals the other from it):
    # both groups train both shards there, so the one that counts covers the global batch
    assert out0["seen"]["first"] == [0, 1]
    # the returning group healed from the survivor, past the step the node was lost at
    again = [r for r in result.steps[1] if r["a"] == 1]
    assert again[0]["healed_to"] == again[0]["step"] - 1 >= shrink.step
    assert grow.step == again[0]["step"]
    failure, = result.failures
    assert (failure.replica, failure.attempt, failure.restarted) == (1, 0, True)
    assert failure.steps_missed >= 10 and not result.given_up
    # after healing, bit-equal weights; the loss is the failure-free run's (same global batch)
    assert torch.equal(out0["weights"], result.results[1][0]["weights"])
    reference = _failure_free_loss(STEPS, 2)
    assert abs(out0["eval_loss"] - reference) <= 0.02, (out0["eval_loss"], reference)
    assert "size 2 -> 1 at step" in result.summary()
    assert not alive(ev["pids"])
    _no_process_left(tmp_path / "ft", gpulaunch_home, lighthouse_pids)


@pytest.mark.slow
def test_below_min_the_run_stops_with_an_error_instead_of_waiting_on_the_quorum(
        tmp_path, gpulaunch_home):
    pytest.importorskip("torchft")
    from gpulaunch import ft
    from gpulaunch.ft.result import read_steps
    capacity = ft.Capacity(2)                   # max 3, but room for 2: min=2 starts with 2
    ev = {}
    lighthouse_pids = set()

    def node_watcher(groups):
        lighthouse_pids.add(groups.lighthouse.pid)
        mine = read_steps(groups.ft_dir, 0)
        if "lost" not in ev and mine and mine[-1]["step"] >= 5:
            capacity.take()
            for pid in ft.group_pids(groups.ft_dir, 1, 0):
                os.kill(pid, signal.SIGKILL)
            ev["lost"] = time.monotonic()

    t0 = time.monotonic()
    with pytest.raises(ft.ReplicasBelowMinError,
                       match=r"1 replica group\(s\) left, fewer than min=2, and no capacity came "
                             r"back within node_lost_timeout=2 s.*every replica group was stopped"):
        ft.run_replicas(_train, 10**6, 0.02, 3, replicas=(2, 3), node_lost_timeout=2.0,
                        capacity=capacity, ft_dir=str(tmp_path / "ft"), on_poll=node_watcher)
    took = time.monotonic() - ev["lost"]
    assert 2.0 <= took < 15, took             # node_lost_timeout, not torchft's quorum timeout
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "ft" / "replica2.steps.jsonl").exists()   # capacity kept it out
    _no_process_left(tmp_path / "ft", gpulaunch_home, lighthouse_pids)


@pytest.mark.slow
def test_a_run_started_on_less_capacity_than_max_grows_when_it_comes(tmp_path, gpulaunch_home):
    """One node at the start: one group trains alone (both shards a step); a second node comes
    and the second group's first start joins and heals from the first."""
    pytest.importorskip("torchft")
    import torch

    from gpulaunch import ft
    capacity = ft.Capacity(1)
    ev = {}
    lighthouse_pids = set()

    until = tmp_path / "until"

    def node_watcher(groups):
        lighthouse_pids.add(groups.lighthouse.pid)
        if "given" not in ev and groups.step >= 10:
            ev["given"] = groups.step
            capacity.give()
        if groups.size == 2 and "grown" not in ev:     # the run ends 30 steps after growing
            ev["grown"] = groups.step
            (tmp_path / "until.tmp").write_text(str(groups.step + 30))
            (tmp_path / "until.tmp").rename(until)

    result = ft.run_replicas(_train, 60, 0.03, 2, str(until), replicas=(1, 2),
                             node_lost_timeout=1.0, capacity=capacity,
                             ft_dir=str(tmp_path / "ft"), on_poll=node_watcher)
    assert [(c.from_size, c.to_size, c.replica) for c in result.size_changes] == [(1, 2, 1)]
    grow, = result.size_changes
    first = result.steps[1][0]
    assert first["a"] == 0 and first["healed_to"] == first["step"] - 1 >= ev["given"]
    assert grow.step == first["step"] and not result.failures and not result.given_up
    assert result.steps[0][0]["step"] == 1 and _monotonic(result.steps[0])
    out0 = result.results[0][0]
    assert out0["seen"][1] == [0, 1]
    assert torch.equal(out0["weights"], result.results[1][0]["weights"])
    _no_process_left(tmp_path / "ft", gpulaunch_home, lighthouse_pids)


@pytest.mark.unit
def test_a_late_group_alone_in_its_quorum_does_not_commit_until_it_has_waited(monkeypatch):
    """A group started after the run reached step 10 whose quorum had none of the live groups
    (it is still at step 0) drops the step and asks again; one that healed (step >= 10), a
    first start (no heal_from) or one that waited ``wait_s`` in vain goes on to commit."""
    from gpulaunch.ft.replicated import ENV_DIR, ENV_HEAL_FROM, _Progress
    monkeypatch.delenv(ENV_DIR, raising=False)
    monkeypatch.setenv(ENV_HEAL_FROM, "10")
    p = _Progress(group_rank=0)
    assert p.quorum_without_peers(0) and p.quorum_without_peers(3)
    assert not p.quorum_without_peers(10)                  # healed to the run's step
    assert not p.quorum_without_peers(0, wait_s=0.0)       # waited long enough: commit, stop
    monkeypatch.setenv(ENV_HEAL_FROM, "-1")
    assert not _Progress(group_rank=0).quorum_without_peers(0)   # a first start
