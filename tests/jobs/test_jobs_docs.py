"""docs/jobs.md: its spec reference is the one generated from the dataclasses, and the recipe
spec it shows is the recipe's. (Its shell blocks run as written in tests/docs/.)"""

from __future__ import annotations

import pytest
from conftest import ROOT

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
