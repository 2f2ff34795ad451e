"""Every entry point goes through one launch pipeline (caller/pipeline.py), so a setting reaches
the ranks the same way whether it came from the decorator, ``submit()`` or ``gpulaunch run``
(real launches, 2 CPU ranks). The settings' derived forms themselves are unit-tested in
tests/launch/test_options.py."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import PY, latest_run_dir, python_env

from gpulaunch import distributed
from gpulaunch.common.rundir import RunDir
from gpulaunch.options import LaunchOptions

PROBE = ("import json, os; print('ENV', json.dumps({k: os.environ.get(k) for k in "
         "('GPULAUNCH_HANG_TIMEOUT', 'EXTRA', 'WORLD_SIZE')}))")


def _rank_env():
    import os
    return {k: os.environ.get(k) for k in ("GPULAUNCH_HANG_TIMEOUT", "EXTRA", "WORLD_SIZE")}


def _cli_env(stdout: str) -> list[dict]:
    return [json.loads(line.split("ENV ", 1)[1]) for line in stdout.splitlines() if "ENV {" in line]


def test_a_setting_reaches_the_ranks_the_same_way_from_every_entry_point(gpulaunch_home):
    want = {"GPULAUNCH_HANG_TIMEOUT": "77.0", "EXTRA": "x", "WORLD_SIZE": "2"}
    fn = distributed(gpus=2, hang_timeout=77, env={"EXTRA": "x"}, stream_logs="none")(_rank_env)
    assert fn.distributed() == [want, want]
    handle = fn.submit()
    assert handle.result(timeout=120) == [want, want]
    # what the agent got is the same typed spec for both
    spec = RunDir(handle.run_dir).launch().spec
    # env= is stored by name only (issue 17: values never reach the disk)
    assert (spec.hang_timeout, "EXTRA" in dict(spec.env)) == (77.0, True)

    cli = subprocess.run([PY, "-m", "gpulaunch.cli", "run", "--gpus", "2", "--hang-timeout", "77",
                          "--env", "EXTRA=x", "--no-tracking", "--", PY, "-c", PROBE],
                         capture_output=True, text=True, timeout=120,
                         env=dict(python_env(), GPULAUNCH_HOME=str(gpulaunch_home)))
    assert cli.returncode == 0, cli.stderr
    assert _cli_env(cli.stdout) == [want, want]
    cli_spec = RunDir(latest_run_dir(gpulaunch_home)).launch().spec
    assert cli_spec.timeout == LaunchOptions().timeout == spec.timeout   # same default: 3 h
    assert cli_spec.hang_timeout == spec.hang_timeout and cli_spec.env == spec.env


def test_nothing_starts_and_no_run_directory_is_made_for_a_refused_launch(gpulaunch_home):
    fn = distributed(gpus=2)(_rank_env)
    before = set(os.listdir(gpulaunch_home / "runs")) if (gpulaunch_home / "runs").exists() \
        else set()
    try:
        fn.with_overrides(gpu_type="H100").distributed()
    except Exception as e:  # noqa: BLE001 - the type is checked below
        assert type(e).__name__ == "GPUTypeError", e
    else:
        raise AssertionError("a GPU type this host lacks was accepted")
    after = set(os.listdir(gpulaunch_home / "runs")) if (gpulaunch_home / "runs").exists() \
        else set()
    assert after == before
