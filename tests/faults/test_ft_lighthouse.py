"""The lighthouse gpulaunch runs for gpulaunch.ft, and the mistakes refused before anything
starts. The lighthouse tests start only the lighthouse process (well under a second each)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
from conftest import alive, python_env

pytest.importorskip("torchft")

from gpulaunch import ft  # noqa: E402
from gpulaunch.errors import ConfigurationError  # noqa: E402


def _answers(address: str) -> bool:
    try:
        with urllib.request.urlopen(address + "/", timeout=5) as r:   # its status page
            return r.status == 200
    except OSError:
        return False


def test_lighthouse_starts_on_loopback_restarts_on_the_same_port_and_stops():
    lh = ft.Lighthouse.start()
    try:
        assert lh.address.startswith("http://127.0.0.1:") and lh.alive() and lh.managed
        assert _answers(lh.address)
        first = lh.pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while lh.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not lh.alive()
        lh.restart()
        assert lh.alive() and lh.restarts == 1 and lh.pid != first
        assert _answers(lh.address)                      # same address as before
    finally:
        lh.stop()
    assert not lh.alive() and not alive([lh.pid])


def test_a_caller_killed_with_sigkill_leaves_no_lighthouse(tmp_path):
    code = textwrap.dedent("""
        import sys, time
        from gpulaunch import ft
        lh = ft.Lighthouse.start()
        print(lh.pid, flush=True)
        time.sleep(600)
    """)
    caller = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=python_env())
    try:
        pid = int(caller.stdout.readline())
        assert alive([pid])
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 10
        while alive([pid]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive([pid]), "the lighthouse outlived its caller"
    finally:
        if caller.poll() is None:
            caller.kill()
        caller.stdout.close()


@pytest.mark.unit
def test_a_lighthouse_address_must_be_a_url():
    with pytest.raises(ConfigurationError, match="http://host:port"):
        ft.Lighthouse.at("127.0.0.1:29510")
    lh = ft.Lighthouse.at("http://10.0.0.5:29510")
    assert lh.alive() and not lh.managed
    with pytest.raises(ft.LighthouseError, match="not run by gpulaunch"):
        lh.restart()


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, match", [
    ({"replicas": 0}, "replicas must be an int >= 1"),
    ({"max_group_restarts": -1}, "max_group_restarts must be an int >= 0"),
    ({"gpus_per_replica": 0}, "gpus_per_replica must be an int >= 1"),
    ({"ranks_per_group": 0}, "ranks_per_group must be an int >= 1"),
    ({"ranks_per_group": 2, "gpus_per_replica": 4}, "give one of them"),
    ({"env": {"A": "1"}}, "pass extra_env="),
    ({"max_restarts": 2}, "restarts itself"),
    ({"gpus": 2}, "not supported here"),
    ({"spares": -1}, "spares must be"),
])
def test_run_replicas_refuses_bad_settings_before_starting_anything(kwargs, match):
    def train():
        return 0
    with pytest.raises(ConfigurationError, match=match):
        ft.run_replicas(train, **kwargs)


@pytest.mark.unit
def test_replicated_outside_run_replicas_says_what_to_call(monkeypatch):
    import torch
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigurationError, match="run_replicas"):
        ft.replicated(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigurationError, match="has no state_dict"):
        ft.replicated(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      lighthouse="http://127.0.0.1:1", state={"steps": 3})
