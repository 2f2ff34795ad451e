"""Preemption: a notice mid-training gives a checkpoint within the grace period, and the run
continues from it (restarted here, or on the next start when the caller itself was preempted);
preemptions and failures are counted apart. Real ranks (gloo), real checkpoints, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import PY, ROOT, assert_no_survivors, python_env

from gpulaunch import distributed
from gpulaunch.caller.failure_policy import Decision, FailurePolicy
from gpulaunch.common import preemption
from gpulaunch.errors import PreemptedError

STEPS = 24


def _train(ckpt: str, steps: int, crash_at=None, sleep: float = 0.05, poll: bool = True):
    """Deterministic DDP loop (data chosen by step and rank), resumable, saving on a notice."""
    import os
    import time

    import torch

    from gpulaunch import runtime as rt
    from gpulaunch.parallel import prepare, resume, save_on_preemption
    rt.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    p = prepare(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2), strategy="ddp")
    step = start = resume(ckpt, p)
    rank, attempt = rt.get_global_rank(), rt.get_restart_count()
    while step < steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 4, generator=g)
        loss = (p.model(x) - x.sum(1, keepdim=True).tanh()).pow(2).mean()
        p.backward(loss)
        p.step()
        p.zero_grad()
        step += 1
        if rank == 0:
            with open(ckpt + ".progress", "a") as f:
                f.write(f"{attempt} {step}\n")
        if crash_at is not None and (attempt, step) == tuple(crash_at) and rank == 1:
            os._exit(3)
        if poll:
            save_on_preemption(ckpt, p, step=step)
        time.sleep(sleep)
    return {"start": start, "attempt": attempt, "step": step,
            "weights": [t.detach().clone() for t in p.model.module.parameters()]}


def _wait_progress(ckpt: str, attempt: int, step: int, timeout: float = 120.0) -> None:
    path = Path(ckpt + ".progress")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and any(line.split() == [str(attempt), str(s)]
                                 for line in path.read_text().splitlines()
                                 for s in range(step, STEPS + 1)):
            return
        time.sleep(0.05)
    raise AssertionError(f"attempt {attempt} never reached step {step}: "
                         f"{path.read_text() if path.exists() else 'no progress'}")


def _same_weights(a, b) -> None:
    for rank in (0, 1):
        for x, y in zip(a[rank]["weights"], b[rank]["weights"]):
            assert torch.equal(x, y)


_CLEAN: list = []


@pytest.fixture
def clean(tmp_path):
    """The uninterrupted run, the reference for every resumed one (run once per session)."""
    if not _CLEAN:
        _CLEAN.append(distributed(gpus=2)(_train).distributed(str(tmp_path / "clean"), STEPS))
    return _CLEAN[0]


@pytest.mark.unit
def test_policy_counts_preemptions_and_failures_apart():
    policy = FailurePolicy(max_restarts=1, max_preemptions=2)
    assert policy.decide(0, preempted=True) is Decision.RESTART
    policy.record(0, "preempted", preempted=True)
    assert policy.decide(1) is Decision.RESTART          # the preemption spent no restart
    policy.record(1, "crash")
    assert policy.decide(2, preempted=True) is Decision.RESTART   # nor the failure a preemption
    policy.record(2, "preempted", preempted=True)
    assert policy.decide(3, preempted=True) is Decision.GIVE_UP
    assert policy.decide(3) is Decision.GIVE_UP
    assert FailurePolicy(2).decide(1) is Decision.RESTART and FailurePolicy(2).decide(2) \
        is Decision.GIVE_UP                             # without preemptions: as before


@pytest.mark.unit
def test_notice_file_round_trip_and_a_second_notice_never_extends(tmp_path):
    first = preemption.post_notice(tmp_path, 10, source="test", restart=True)
    again = preemption.post_notice(tmp_path, 60, source="later", restart=False)
    assert again == first and preemption.read_notice(tmp_path) == first
    assert 9 < first.remaining() <= 10 and first.grace_s == pytest.approx(10)
    assert oct((tmp_path / preemption.NOTICE_FILE).stat().st_mode & 0o777) == "0o600"
    (tmp_path / "attempt0").mkdir()
    preemption.archive_notice(tmp_path, 0)
    assert preemption.read_notice(tmp_path) is None
    assert (tmp_path / "attempt0" / preemption.NOTICE_FILE).exists()


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_notice_saves_then_restarts_without_spending_max_restarts(tmp_path, clean, warm):
    ckpt = str(tmp_path / "ck")
    fn = distributed(gpus=2, max_restarts=0, max_preemptions=1, keep_alive=warm)(_train)
    try:
        h = fn.submit(ckpt, STEPS)
        _wait_progress(ckpt, 0, 6)
        notice = h.preempt(grace_s=30)
        out = h.result(timeout=180)
    finally:
        if warm:
            import gpulaunch
            gpulaunch.shutdown()
    saved = preemption.read_saved(h.run_dir, 0)
    assert saved is not None and saved["notice"]["received_at"] == notice.received_at
    assert saved["saved_at"] - notice.received_at < notice.grace_s   # within the grace
    assert out[0]["attempt"] == 1 and out[0]["start"] == saved["step"] >= 6
    assert (h.preemptions, h.failures) == (1, 0)
    _same_weights(out, clean)                   # continued from the checkpoint, bit-exact
    assert preemption.read_notice(h.run_dir) is None       # the restarted attempt saw none


def test_a_failure_and_a_preemption_each_spend_their_own_budget(tmp_path, clean):
    ckpt = str(tmp_path / "ck")
    fn = distributed(gpus=2, max_restarts=1, max_preemptions=1)(_train)
    h = fn.submit(ckpt, STEPS, crash_at=(1, 14))       # attempt 1: rank 1 dies at step 14
    _wait_progress(ckpt, 0, 5)
    h.preempt(grace_s=30)
    out = h.result(timeout=240)
    assert out[0]["attempt"] == 2
    assert [a.preempted for a in h.attempts] == [True, False]
    assert (h.preemptions, h.failures) == (1, 1)
    _same_weights(out, clean)


def test_a_preemption_over_budget_stops_with_the_checkpoint_step(tmp_path):
    ckpt = str(tmp_path / "ck")
    h = distributed(gpus=2, max_restarts=3, max_preemptions=0)(_train).submit(ckpt, STEPS)
    _wait_progress(ckpt, 0, 4)
    h.preempt(grace_s=30)
    with pytest.raises(PreemptedError) as e:
        h.result(timeout=120)
    saved = preemption.read_saved(h.run_dir, 0)
    assert e.value.step == saved["step"] and f"checkpoint of step {saved['step']}" in str(e.value)
    assert h.attempts == []                         # max_restarts was not used for it
    assert_no_survivors(h.run_dir)


def test_a_grace_too_short_stops_the_run_with_a_clear_error(tmp_path):
    """The loop never acts on the notice (no save_on_preemption): the grace period ends, every
    rank is stopped, PreemptedError says what to do; no hang, nothing left."""
    ckpt = str(tmp_path / "ck")
    h = distributed(gpus=2)(_train).submit(ckpt, 10_000, poll=False)
    _wait_progress(ckpt, 0, 3)
    began = time.monotonic()
    h.preempt(grace_s=1, restart=False)
    with pytest.raises(PreemptedError, match="grace period ended before every rank had saved"):
        h.result(timeout=60)
    assert time.monotonic() - began < 30
    assert_no_survivors(h.run_dir)


SCRIPT = """
import sys, torch
sys.path[:0] = [{tests!r}, {tests_root!r}]
from test_preemption import _train
from gpulaunch import distributed

if __name__ == "__main__":
    fn = distributed(gpus=2, preempt_grace=30, keep_alive={warm})(_train)
    out = fn.distributed({ckpt!r}, {steps})
    torch.save([r["weights"] for r in out], {weights!r})
    print("START", out[0]["start"])
"""


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_sigterm_to_the_caller_checkpoints_and_the_next_start_resumes(tmp_path, clean, warm):
    ckpt, weights = str(tmp_path / "ck"), str(tmp_path / "w.pt")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(
        tests=str(ROOT / "tests" / "faults"), tests_root=str(ROOT / "tests"), ckpt=ckpt,
        steps=STEPS, weights=weights, warm=warm)))
    env = python_env()
    first = subprocess.Popen([PY, str(script)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    _wait_progress(ckpt, 0, 6)
    sent = time.time()
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=120)
    assert first.returncode != 0, out
    assert "PreemptedError: Preempted (SIGTERM to the caller, grace 30 s): checkpoint of step" \
        in out and "the next start resumes from it" in out, out
    runs = sorted((Path(os.environ["GPULAUNCH_HOME"]) / "runs").iterdir())
    saved = preemption.read_saved(runs[-1], 0)
    assert saved["saved_at"] - sent < 30
    assert_no_survivors(runs[-1])
    second = subprocess.run([PY, str(script)], env=env, capture_output=True, text=True,
                            timeout=180)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"START {saved['step']}" in second.stdout
    resumed = torch.load(weights)
    for rank in (0, 1):
        for x, y in zip(resumed[rank], clean[rank]["weights"]):
            assert torch.equal(x, y)


@pytest.mark.unit
def test_rank_view_sees_a_notice_with_one_stat(tmp_path, monkeypatch):
    from gpulaunch import runtime as rt
    monkeypatch.setenv("GPULAUNCH_RUN_DIR", str(tmp_path))
    assert rt.preemption() is None
    notice = preemption.post_notice(tmp_path, 5, source="test", restart=True)
    assert rt.preemption() == notice
    (tmp_path / preemption.NOTICE_FILE).unlink()
    assert rt.preemption() is None
    assert json.loads(json.dumps(notice.__dict__))["source"] == "test"


@pytest.mark.unit
def test_a_notice_for_a_ray_run_is_refused_by_name(tmp_path):
    from types import SimpleNamespace

    from gpulaunch.caller import preemption as caller_preemption
    from gpulaunch.errors import ConfigurationError
    run = SimpleNamespace(record=SimpleNamespace(backend="ray"), run=SimpleNamespace(path=tmp_path))
    with pytest.raises(ConfigurationError, match="runs on this host only; this run is on 'ray'"):
        caller_preemption.post(run, 5, source="test", restart=True)
    assert preemption.read_notice(tmp_path) is None
