"""No environment pollution (issue 17): ranks and `gpulaunch run` children get the caller's
PYTHONPATH unchanged; an installed gpulaunch never puts site-packages first; only a source
checkout that a child could not import otherwise gets its root added.

Each case is a real interpreter importing a real copy of the package from where an install or
a checkout would put it (sys.path set inside the process, so PYTHONPATH is the caller's own)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from conftest import PY, ROOT

from gpulaunch import distributed

PROBE = ("import sys, json; sys.path.insert(0, {where!r}); "
         "from gpulaunch.backends.local.run import child_env; import gpulaunch; "
         "print(json.dumps([gpulaunch.__file__, child_env().get('PYTHONPATH')]))")


def _copy_package(folder: Path) -> Path:
    folder.mkdir(parents=True)
    shutil.copytree(ROOT / "src" / "gpulaunch", folder / "gpulaunch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def _child_pythonpath(where: Path, pythonpath: str | None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([PY, "-c", PROBE.format(where=str(where))], capture_output=True,
                         text=True, timeout=60, env=env, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_installed_gpulaunch_adds_nothing_to_pythonpath(tmp_path):
    site = _copy_package(tmp_path / "lib" / "python3" / "site-packages")
    file, pythonpath = _child_pythonpath(site, None)
    assert file.startswith(str(site))                       # the copy is what ran
    assert pythonpath is None                               # not site-packages, first or at all
    file, pythonpath = _child_pythonpath(site, "/my/libs")
    assert pythonpath == "/my/libs"


def test_a_source_checkout_not_importable_otherwise_gets_its_root_only(tmp_path):
    checkout = _copy_package(tmp_path / "checkout" / "src")
    file, pythonpath = _child_pythonpath(checkout, "/my/libs")
    assert file.startswith(str(checkout))
    assert pythonpath.split(os.pathsep) == [str(checkout), "/my/libs"]


def test_a_checkout_already_on_pythonpath_is_left_exactly_as_it_was(tmp_path):
    checkout = _copy_package(tmp_path / "checkout" / "src")
    value = os.pathsep.join(["/first", str(checkout), "/last"])
    assert _child_pythonpath(checkout, value)[1] == value


def test_ranks_see_the_callers_pythonpath_unchanged(monkeypatch):
    value = os.pathsep.join([str(ROOT / "src"), "/not/a/real/dir"])
    monkeypatch.setenv("PYTHONPATH", value)

    def f():
        import os
        return os.environ.get("PYTHONPATH")

    assert distributed(gpus=2)(f).distributed() == [value, value]
