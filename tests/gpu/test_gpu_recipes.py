"""Every recipe of recipes/ on the GPUs of this host, at its small (default) settings, run as a
user runs it (``python recipes/<name>.py ...``), each training to a lower loss.

The eight recipes run side by side in the background (recipe_runs.py), started by conftest's
``recipes_started`` as soon as the tests that need a quiet GPU are done; each test here waits
for its own recipe and checks what it wrote.
"""

from __future__ import annotations

import importlib.util
import math
import re

import pytest

from .recipe_runs import DEADLINE_S, SPECS, Started

pytestmark = [pytest.mark.gpu, pytest.mark.recipe]


def _finished(recipes_started, name: str, record, keep) -> Started:
    run = recipes_started.runs[name]
    keep(run.log)
    for module, wheel in SPECS[name].needs:
        if importlib.util.find_spec(module) is None:
            pytest.fail(f"{module} is not importable on this GPU host: its wheel ({wheel}) was "
                        "not carried (scripts/gpu_wheels.sh builds .whl/)", pytrace=False)
    code = run.wait(recipes_started.deadline)
    record(recipe=name, seconds=run.seconds, exit_code=code)
    assert code is not None, (f"{name} still running at the recipes' deadline ({DEADLINE_S} s "
                              f"or the suite's cap); last output:\n{run.tail()}")
    assert code == 0, f"{name} exited {code}; output:\n{run.tail()}"
    return run


@pytest.mark.timeout(DEADLINE_S + 30)
def test_quickstart(recipes_started, gpu, record, keep):
    text = _finished(recipes_started, "quickstart", record, keep).log.read_text()
    assert f"ranks: {list(range(gpu.count))}" in text, text[-3000:]
    losses = [float(v) for v in re.findall(r"step +\d+ +loss ([0-9.]+)", text)]
    assert len(losses) >= 2 and losses[-1] < 0.5 * losses[0], losses
    record(losses=losses)


def _check_common(r: dict, gpu, name: str) -> None:
    assert r["device"] == "cuda" and r["world_size"] == gpu.count, (name, r["device"],
                                                                   r["world_size"])


@pytest.mark.timeout(DEADLINE_S + 30)
def test_pytorch_mlp_ddp(recipes_started, gpu, record, keep):
    r = _finished(recipes_started, "pytorch_mlp_ddp", record, keep).result()
    _check_common(r, gpu, "pytorch_mlp_ddp")
    record(before=r["before"], after=r["after"], samples_per_s=r["samples_per_s"])
    assert r["after"] < 0.7 * r["before"], (r["before"], r["after"])


@pytest.mark.timeout(DEADLINE_S + 30)
def test_pytorch_transformer_fsdp(recipes_started, gpu, record, keep):
    r = _finished(recipes_started, "pytorch_transformer_fsdp", record, keep).result()
    _check_common(r, gpu, "pytorch_transformer_fsdp")
    record(before=r["before"], after=r["after"], accuracy_after=r["accuracy_after"])
    assert r["strategy"] == "fsdp" and r["final_step"] == r["config"]["steps"]
    assert r["after"] < r["before"] - 0.5, (r["before"], r["after"])
    assert r["checkpoints"], "no checkpoint was written"


@pytest.mark.timeout(DEADLINE_S + 30)
def test_pytorch_retinanet_ddp(recipes_started, gpu, record, keep):
    r = _finished(recipes_started, "pytorch_retinanet_ddp", record, keep).result()
    _check_common(r, gpu, "pytorch_retinanet_ddp")
    record(loss_first=r["loss_first"], loss_last=r["loss_last"], map_after=r["after"])
    assert all(math.isfinite(v) for v in r["loss_history"])
    assert r["loss_last"] < 0.9 * r["loss_first"], (r["loss_first"], r["loss_last"])
    assert 0.0 <= r["before"] <= 1.0 and 0.0 <= r["after"] <= 1.0   # mAP computed


@pytest.mark.timeout(DEADLINE_S + 30)
def test_lightning_two_tower_ddp(recipes_started, gpu, record, keep):
    r = _finished(recipes_started, "lightning_two_tower_ddp", record, keep).result()
    _check_common(r, gpu, "lightning_two_tower_ddp")
    record(before=r["before"], after=r["after"], test_auroc=r["test_auroc"])
    assert r["cluster_environment"] == "TorchElasticEnvironment", r["cluster_environment"]
    assert r["after"] > r["before"] + 0.1 and r["after"] > 0.7, (r["before"], r["after"])


@pytest.mark.timeout(DEADLINE_S + 30)
@pytest.mark.parametrize("name,technique,wrapper", [
    ("trl_sft_lora_ddp", "ddp", "ddp"),
    ("trl_sft_lora_fsdp", "fsdp2", "fsdp2"),
    ("trl_sft_full_zero3", "zero3", "deepspeed")])
def test_trl_recipe(name, technique, wrapper, recipes_started, gpu, record, keep):
    run = _finished(recipes_started, name, record, keep)
    r = run.result()
    record(eval_losses=r["eval_losses"], technique=r["technique"], wrapper=r["wrapper"],
           peak_memory_gib=r["peak_memory_gib"])
    assert r["technique"] == technique and r["world_size"] == gpu.count, r
    assert r["precision"] == "bf16", r["precision"]
    if wrapper != "ddp" or gpu.count > 1:   # at world size 1 the HF Trainer wraps no DDP
        assert r["wrapper"] == wrapper, r["wrapper"]
    assert r["eval_loss_after"] < 0.9 * r["eval_loss_before"], r["eval_losses"]
    if name == "trl_sft_full_zero3":
        assert r["export_check"]["ok"] and r["export_check"]["max_abs_diff"] == 0.0, \
            r["export_check"]
    assert "generated:" in run.log.read_text(), "no reload + generation after training"
