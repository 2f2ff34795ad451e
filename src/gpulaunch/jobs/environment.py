"""The Python a job runs in: the submitting interpreter, an existing environment
(``environment.python``), or a venv built from ``environment.requirements``.

A built venv is keyed by a hash of its content (the requirement lines, the base interpreter
and its version), built once under ``<home>/envs/<hash>`` and reused by every later job that
asks for the same. It layers on top of the base interpreter's packages (a ``.pth`` file adds
the base site-packages after its own), so torch and gpulaunch are not installed again and pip
only adds what is missing. A build that fails leaves no cache entry: the job fails with pip's
own error before any GPU is asked for, and the next job tries again.

Concurrent builds of one hash wait on a lock file; the wait polls, so a job cancelled while
waiting ends at once (a blocking lock would hold it until the other build finished).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from ..common import rundir
from ..errors import ConfigurationError

COMPLETE = ".gpulaunch-complete"
PIP_TAIL_LINES = 25


class EnvironmentBuildError(ConfigurationError):
    """pip could not install the job's requirements; the message carries pip's output."""


def interpreter_of(path: str) -> str:
    """A python executable from ``environment.python``: the executable, or a venv/conda
    folder holding ``bin/python``."""
    p = Path(os.path.expanduser(path))
    if p.is_dir():
        for candidate in (p / "bin" / "python", p / "bin" / "python3"):
            if candidate.exists():
                return str(candidate)
        raise ConfigurationError(f"{path!r} is a folder without bin/python: give a venv or conda "
                                 "environment folder, or the python executable itself")
    if p.is_file() and os.access(p, os.X_OK):
        return str(p)
    found = shutil.which(path)
    if found:
        return found
    raise ConfigurationError(f"{path!r} is neither a python executable nor an environment "
                             "folder")


def env_hash(requirements: list[str], base: str | None = None) -> str:
    base = base or sys.executable
    key = {"requirements": list(requirements), "base": os.path.realpath(base),
           "version": sys.version, "layout": 1}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def envs_root() -> Path:
    return rundir.home() / "envs"


def _base_site_paths() -> list[str]:
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return sorted(p for p in paths if os.path.isdir(p))


def _venv_site(venv: Path) -> Path:
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return venv / "lib" / ver / "site-packages"


def _lock(path: Path, cancelled) -> object:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if cancelled():
                os.close(fd)
                raise InterruptedError("cancelled while waiting for another job's environment "
                                       "build")
            time.sleep(0.2)


def build(requirements: list[str], *, log=None, cancelled=lambda: False) -> str:
    """The python of the venv for ``requirements``, built now unless already cached."""
    digest = env_hash(requirements)
    root = envs_root()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    venv = root / digest
    python = venv / "bin" / "python"
    if (venv / COMPLETE).exists():
        return str(python)
    fd = _lock(root / f"{digest}.lock", cancelled)
    try:
        if (venv / COMPLETE).exists():             # built by another job while we waited
            return str(python)
        if venv.exists():
            shutil.rmtree(venv)                    # a build that died half way
        _say(log, f"building the job's environment {digest} ({len(requirements)} "
                  "requirement(s)); later jobs with the same requirements reuse it")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        site = _venv_site(venv)
        site.mkdir(parents=True, exist_ok=True)
        (site / "_gpulaunch_base.pth").write_text("\n".join(_base_site_paths()) + "\n")
        p = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check",
                            *requirements], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            tail = "\n".join(p.stdout.strip().splitlines()[-PIP_TAIL_LINES:])
            raise EnvironmentBuildError(f"pip could not install the job's requirements "
                                        f"(exit {p.returncode}):\n{tail}")
        _say(log, p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "pip: done")
        (venv / COMPLETE).write_text(json.dumps({"requirements": requirements,
                                                 "built": time.time()}))
        return str(python)
    finally:
        os.close(fd)


def python_for(spec, *, log=None, cancelled=lambda: False) -> str:
    """The interpreter an attempt of ``spec`` runs with on this host (or a shared disk)."""
    e = spec.environment
    if e.python:
        return interpreter_of(e.python)
    if e.requirements:
        return build(list(e.requirements), log=log, cancelled=cancelled)
    return sys.executable


def _say(log, text: str) -> None:
    if log is not None:
        log(text)
