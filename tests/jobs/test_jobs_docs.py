"""docs/jobs.md: its spec reference is the one generated from the dataclasses, and every shell
block in it runs as written (in order, from the repository root, on CPU workers)."""

from __future__ import annotations

import os
import re
import stat
import subprocess

import pytest
from conftest import PY, ROOT, python_env

DOC = ROOT / "docs" / "jobs.md"


@pytest.mark.unit
def test_spec_reference_in_the_doc_is_generated_from_the_dataclasses():
    from gpulaunch.jobs import reference
    text = DOC.read_text()
    assert reference.render(text) == text, \
        "docs/jobs.md is out of date: python -m gpulaunch.jobs.reference --write docs/jobs.md"
    for key in ("compute.slurm.partition", "environment.requirements", "retry.max_retries",
                "launch.hang_timeout", "tracking.experiment"):
        assert f"`{key}`" in text


@pytest.mark.unit
def test_the_recipe_spec_is_valid_and_the_doc_shows_it_as_it_is():
    from gpulaunch.jobs import resolve
    spec_file = ROOT / "recipes" / "jobs" / "fsdp_finetune" / "job.yaml"
    spec = resolve.load(spec_file, ["compute.gpus=2"])
    assert spec.command.script == "train.py" and spec.retry.max_retries == 2
    body = "\n".join(line for line in spec_file.read_text().splitlines()
                     if not line.startswith("#"))
    assert body.strip() in DOC.read_text()


def _blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_shell_block_runs_as_written(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "gpulaunch"          # the console script, where the package is not installed
    shim.write_text(f"#!/bin/sh\nexec {PY} -m gpulaunch.cli \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    env = python_env({"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    blocks = _blocks()
    assert len(blocks) >= 5
    outputs = []
    for block in blocks:
        p = subprocess.run(["bash", "-e", "-c", block], cwd=ROOT, env=env, text=True,
                           capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
        assert p.returncode == 0, f"{block}\nexited {p.returncode}\n{p.stdout}\n{p.stderr}"
        outputs.append(p.stdout + p.stderr)
    assert "[rank 0] step 20 loss" in outputs[0], outputs[0]
    assert "SUCCEEDED" in outputs[1], outputs[1]
    assert "#SBATCH --nodes=2" in "".join(outputs) and "#SBATCH --partition=gpu" in \
        "".join(outputs)
    assert '"submission_id": "fsdp-finetune-<id>-a1"' in "".join(outputs)
