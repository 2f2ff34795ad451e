"""A standby agent that is never stale (issue 17): a package installed or upgraded since it
started (``%pip install -U ...``), or a start-up variable it cannot adopt (TORCHINDUCTOR_*,
LANG, TMPDIR...), makes the next call start cold; the standby's stderr goes to a log.
Real standby processes, real folders on the import path."""

from __future__ import annotations

import os

import pytest
from conftest import ROOT

from gpulaunch import distributed
from gpulaunch.backends.local.standby import STANDBY, stderr_log_path
from gpulaunch.common.rundir import RunDir

pytestmark = pytest.mark.slow


def _run_dir():
    import os
    return os.environ["GPULAUNCH_RUN_DIR"]


def _launch_warm() -> bool:
    fn = distributed(gpus=1, stream_logs="none")(_run_dir)
    run_dir = fn.distributed()[0]
    return bool(RunDir(run_dir).status().warm_start)


def _standby_ready():
    assert STANDBY.pid() is not None and STANDBY.wait_ready(120), "no ready standby"


@pytest.fixture
def fresh_standby(monkeypatch, tmp_path):
    STANDBY.close()
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "src"), str(site)]))
    monkeypatch.delenv("GPULAUNCH_STANDBY", raising=False)
    yield site
    STANDBY.close()


def test_an_install_since_the_standby_started_makes_the_call_cold(fresh_standby):
    _launch_warm()                           # cold; a standby starts after it
    _standby_ready()
    assert _launch_warm() is True            # control: nothing changed, it is used
    _standby_ready()
    (fresh_standby / "newpkg-1.0.dist-info").mkdir()      # what `pip install newpkg` leaves
    assert _launch_warm() is False           # the standby had imported the old world
    assert stderr_log_path().exists()
    assert stat_mode(stderr_log_path()) == 0o600


@pytest.mark.parametrize("name", ["TORCHINDUCTOR_CACHE_DIR", "LANG", "TMPDIR"])
def test_a_changed_start_up_variable_makes_the_call_cold(fresh_standby, monkeypatch, name,
                                                         tmp_path):
    _launch_warm()
    _standby_ready()
    monkeypatch.setenv(name, str(tmp_path) if name != "LANG" else "POSIX")
    assert os.environ.get(name) != STANDBY._startup.get(name)   # it did change
    assert _launch_warm() is False


def stat_mode(path) -> int:
    return os.stat(path).st_mode & 0o777
