"""The command line as a user types it: the installed ``gpulaunch`` script and ``python -m
gpulaunch``, each in a process of its own, against this checkout."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import PY, ROOT, python_env

SCRIPT = Path(sys.executable).parent / "gpulaunch"
PLAN = ["plan", "llama-3.1-8b", "--gpu", "H100", "--gpus-per-node", "8", "--seq-len", "4096",
        "--micro-batch-size", "1"]


def _entry_points() -> list[list[str]]:
    out = [[PY, "-m", "gpulaunch"]]
    if SCRIPT.exists():      # the console script pip installed (it imports this checkout: PYTHONPATH)
        out.append([str(SCRIPT)])
    return out


@pytest.fixture(params=_entry_points(), ids=lambda c: "script" if len(c) == 1 else "python-m")
def gpulaunch_cmd(request):
    return request.param


def cli(cmd: list[str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*cmd, *args], env=python_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_plan_as_documented(gpulaunch_cmd):
    r = cli(gpulaunch_cmd, *PLAN)
    assert r.returncode == 0, r.stderr
    assert "invalid choice" not in r.stderr
    assert "llama-3.1-8b" in r.stdout and "8 H100" in r.stdout
    assert re.search(r"recommended: \w+", r.stdout), r.stdout


def test_plan_json_is_machine_readable(gpulaunch_cmd):
    r = cli(gpulaunch_cmd, *PLAN, "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["recommended"] == "fsdp" and plan["gpus_per_node"] == 8, plan["reason"]


def test_plan_bad_model_is_a_clear_error(gpulaunch_cmd):
    r = cli(gpulaunch_cmd, "plan", "no-such-model-xyz", "--gpu", "H100")
    assert r.returncode == 2
    assert "gpulaunch plan: error:" in r.stderr and "no-such-model-xyz" in r.stderr


def test_version_agrees_with_the_package(gpulaunch_cmd):
    import gpulaunch
    r = cli(gpulaunch_cmd, "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"gpulaunch {gpulaunch.__version__}"


def test_every_subcommand_has_help(gpulaunch_cmd):
    r = cli(gpulaunch_cmd, "--help")
    assert r.returncode == 0, r.stderr
    commands = re.search(r"\{([\w,-]+)\}", r.stdout).group(1).split(",")
    for expected in ("run", "runs", "logs", "stacks", "debug", "doctor", "pool", "plan"):
        assert expected in commands, r.stdout
    for command in commands:
        h = cli(gpulaunch_cmd, command, "--help")
        assert h.returncode == 0, (command, h.stderr)
        assert "usage: gpulaunch" in h.stdout, (command, h.stdout)


def test_one_version_source(tmp_path):
    """pyproject.toml takes its version from ``gpulaunch.__version__``: the metadata setuptools
    builds for this checkout (what ``pip show`` reads) says the same version."""
    import gpulaunch
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gpulaunch.__version__"}
    code = ("import sys; from setuptools import build_meta; "
            "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    r = subprocess.run([PY, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    meta = (tmp_path / r.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert f"\nVersion: {gpulaunch.__version__}\n" in meta
