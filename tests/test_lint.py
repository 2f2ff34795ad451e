"""ruff over the whole checkout (pyproject's [tool.ruff]): pyflakes (undefined names, unused
imports), pycodestyle and import order, notebooks included."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATHS = ["src", "tests", "bench", "recipes", "scripts"]


def _ruff() -> list[str]:
    try:
        import ruff  # noqa: F401  (the test extra installs it)
        return [sys.executable, "-m", "ruff"]
    except ImportError:
        exe = shutil.which("ruff")
        if exe is None:
            pytest.skip("ruff is not installed (pip install -e '.[test]')")
        return [exe]


def test_ruff_is_clean():
    out = subprocess.run([*_ruff(), "check", "--output-format", "concise", *PATHS], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr

