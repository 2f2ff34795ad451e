"""bench/ft_goodput.py runs end to end (--quick: one SIGKILL in a short run of each mode) and
reports what it measured. Benchmarks are never pass/fail on time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ft_goodput_quick(tmp_path):
    out = tmp_path / "ft.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ft_goodput.py"), "--quick",
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=280, cwd=ROOT, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    ft, ckpt = data["modes"]["ft"]["with_failures"], data["modes"]["ckpt"]["with_failures"]
    assert ft["kills"] == 1 and ckpt["kills"] == 1
    assert ft["batches"] > 0 and ckpt["batches"] > 0
    (failure,) = ft["failures"]
    assert failure["healed_to"] is not None           # the replacement healed from its peer
    assert ft["recovery_s"][0] is not None and ft["recovery_s"][0] > 0
