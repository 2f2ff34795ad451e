"""``@distributed(replicas=...)``: the decorator's call as fault-tolerant replica groups.

The pure part (the ``Replicas`` record and the settings it refuses) is checked without a
process. The real run: two groups of a decorated function, one of them SIGKILLed by its own
hand mid-run (``os.kill(os.getpid(), SIGKILL)``, nothing mocked), and ``.distributed()``
returns a ``ReplicasResult`` that names the failed group, when it failed and how many steps it
missed; the replacement heals and both groups end with bit-equal weights.
"""

from __future__ import annotations

import pytest

from gpulaunch import distributed, ft
from gpulaunch.errors import ConfigurationError
from gpulaunch.ft.run import group_settings, launch_settings

STEPS = 40


# ----------------------------------------------------------------------- pure: the record
@pytest.mark.parametrize("value, size, elastic", [(2, 2, False), ((1, 3), (1, 3), True),
                                                  ([1, 2], (1, 2), True)])
def test_replicas_accepts_a_count_or_a_min_max_pair(value, size, elastic):
    spec = ft.Replicas.of(value)
    assert spec.size == size and spec.elastic is elastic
    assert spec.run_kwargs() == {"replicas": size, "max_group_restarts": 3}
    assert distributed(replicas=value)(lambda: 0).options.replicas == spec


@pytest.mark.parametrize("value, words", [
    (0, "an int >= 1"), (True, "an int >= 1"), ("2", "an int >= 1"), ((2, 1), "min <= max"),
    ((1, 2, 3), "(min, max)"), ((0, 2), "1 <= min")])
def test_bad_replicas_are_refused_at_decoration_with_the_fix(value, words):
    with pytest.raises(ConfigurationError, match=r"replicas=") as e:
        distributed(replicas=value)(lambda: 0)
    assert words in str(e.value)


@pytest.mark.parametrize("setting, words", [
    ({"keep_alive": True}, "drop keep_alive"), ({"max_restarts": 2}, "max_group_restarts"),
    ({"remote": True}, "on this host")])
def test_settings_that_do_not_go_with_replicas_are_refused(setting, words):
    with pytest.raises(ConfigurationError, match=words):
        distributed(replicas=2, **setting)(lambda: 0)


def test_replicas_record_checks_its_elastic_fields():
    with pytest.raises(ConfigurationError, match="elastic size"):
        ft.Replicas(2, node_lost_timeout=30)
    with pytest.raises(ConfigurationError, match="elastic size"):
        ft.Replicas(2, capacity=ft.Capacity(2))
    with pytest.raises(ConfigurationError, match="seconds > 0"):
        ft.Replicas((1, 2), node_lost_timeout=0)
    with pytest.raises(ConfigurationError, match="max_group_restarts"):
        ft.Replicas(2, max_group_restarts=-1)
    spec = ft.Replicas((1, 2), node_lost_timeout=5, max_group_restarts=1)
    assert spec.run_kwargs() == {"replicas": (1, 2), "max_group_restarts": 1,
                                 "node_lost_timeout": 5}


def test_submit_is_refused_and_each_group_gets_the_changed_settings_only():
    f = distributed(replicas=2, timeout=120, env={"A": "1"}, stream_logs="rank0")(lambda: 0)
    with pytest.raises(ConfigurationError, match=r"\.distributed\(\.\.\.\)"):
        f.submit()
    assert launch_settings(f.options) == {"timeout": 120.0, "stream_logs": "rank0",
                                          "extra_env": {"A": "1"}}
    assert group_settings(f.options) == {"replicas": 2, "max_group_restarts": 3,
                                         "ranks_per_group": 1, "timeout": 120.0,
                                         "stream_logs": "rank0", "extra_env": {"A": "1"}}
    hsdp = distributed(replicas=(1, 3), gpus=2)(lambda: 0)       # 3 groups of 2 ranks
    assert group_settings(hsdp.options) == {"replicas": (1, 3), "max_group_restarts": 3,
                                            "ranks_per_group": 2}


# ----------------------------------------------------------------------- real: a kill mid-run
def _train(steps: int, kill_at: int):
    import os
    import signal
    import time

    import torch

    from gpulaunch import ft
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    r = ft.replicated(model, torch.optim.Adam(model.parameters(), lr=0.05))
    while r.step < steps:
        if ft.replica_id() == 1 and ft.attempt() == 0 and r.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)       # this group's process dies, mid-run
        r.optimizer.zero_grad()
        g = torch.Generator().manual_seed(1000 * r.step + ft.replica_id())
        x = torch.randn(16, 8, generator=g)
        torch.nn.functional.mse_loss(r.model(x), x.sum(1, keepdim=True).tanh()).backward()
        r.optimizer.step()
        time.sleep(0.05)
    out = {**r.summary(), "weights": torch.cat([p.detach().flatten()
                                                for p in model.parameters()])}
    r.shutdown()
    return out


@pytest.mark.slow
def test_decorated_function_runs_as_replica_groups_and_reports_the_failure(gpulaunch_home):
    pytest.importorskip("torchft")
    import torch

    train = distributed(replicas=ft.Replicas(2, max_group_restarts=1), timeout=180)(_train)
    result = train.distributed(STEPS, kill_at=15)

    assert isinstance(result, ft.ReplicasResult)
    assert [(f.replica, f.attempt, f.restarted) for f in result.failures] == [(1, 0, True)]
    failure = result.failures[0]
    assert failure.last_step is not None and failure.last_step <= 15
    assert failure.healed_to is not None and failure.healed_to >= failure.last_step
    assert failure.steps_missed is not None and failure.down_s is not None
    assert "replica 1 attempt 0" in result.summary()
    assert sorted(result.results) == [0, 1] and not result.given_up
    assert result.results[1][0]["attempt"] == 1
    assert torch.equal(result.results[0][0]["weights"], result.results[1][0]["weights"])
