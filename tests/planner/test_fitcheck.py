"""The launcher's memory check (``@distributed(plan=...)``, ``gpulaunch run --plan``): the planner's
estimate against the GPUs a launch gets, before anything starts."""

from __future__ import annotations

import subprocess

import pytest
from conftest import PY, python_env

from gpulaunch import distributed
from gpulaunch.caller import fitcheck
from gpulaunch.caller.spec import resolve
from gpulaunch.errors import ConfigurationError, WontFitError
from gpulaunch.hardware.host import GPUInfo, HostInfo
from gpulaunch.options import LaunchOptions

GiB = 1 << 30
H100 = 81559 * (1 << 20)


def host(n: int, name: str = "NVIDIA H100 80GB HBM3", memory: int = H100) -> HostInfo:
    """The description of a GPU host, as launch.hardware would report it (pure data)."""
    return HostInfo(gpus=tuple(GPUInfo(i, name, memory) for i in range(n)), cpu_count=64, source="nvml")


def verdict(plan, n=8, **host_kw):
    h = host(n, **host_kw)
    return fitcheck.check_launch(fitcheck.validate(plan), resolve(LaunchOptions(gpus=n), h), h)


@pytest.mark.unit
def test_fitting_strategy_passes_with_its_predicted_peak():
    v = verdict({"model": "llama-3.1-8b", "strategy": "fsdp", "seq_len": 2048})
    assert v.fits and v.strategy == "fsdp"
    assert 0 < v.peak_gib < 80
    assert "fsdp fits on 8 x H100" in v.message


@pytest.mark.unit
def test_strategy_that_does_not_fit_is_refused_naming_what_would():
    # 8B params under DDP: 16 bytes/param = 128 GB per GPU > 80 GB, whatever the activations.
    with pytest.raises(WontFitError) as e:
        verdict({"model": "llama-3.1-8b", "strategy": "ddp", "seq_len": 2048})
    msg = str(e.value)
    assert "ddp does not fit on 8 x H100" in msg
    assert "would (" in msg                    # names the recommendation
    assert "Nothing was started" in msg and "on_fail" in msg
    peak = float(msg.split("predicted peak ")[1].split(" GiB")[0])
    assert peak > 8.03e9 * 16 / GiB            # at least the model states, by hand


@pytest.mark.unit
def test_nothing_fits_is_refused_even_without_a_strategy():
    with pytest.raises(WontFitError, match="nothing fits on 1 x H100"):
        verdict({"model": "llama-3.1-70b", "offload": False}, n=1)  # 70B x 16 B on 80 GB: no


@pytest.mark.unit
def test_no_strategy_reports_the_planners_pick():
    v = verdict({"model": "llama-3.2-1b", "seq_len": 1024})
    assert v.fits and v.recommended == v.strategy


@pytest.mark.unit
def test_on_fail_warn_launches_anyway():
    with pytest.warns(UserWarning, match="ddp does not fit"):
        v = verdict({"model": "llama-3.1-8b", "strategy": "ddp", "on_fail": "warn"})
    assert not v.fits


@pytest.mark.unit
def test_smallest_gpu_of_a_mixed_host_is_the_one_checked():
    mixed = HostInfo(gpus=(GPUInfo(0, "NVIDIA H200", 143771 << 20), GPUInfo(1, "NVIDIA H100 80GB HBM3", H100)),
                     cpu_count=32, source="nvml")
    v = fitcheck.check_launch({"model": "llama-3.2-1b", "strategy": "ddp"}, resolve(LaunchOptions(gpus=2), mixed), mixed)
    assert abs(v.gpu_gib - H100 / GiB) < 0.01


@pytest.mark.unit
def test_cpu_workers_are_not_checked():
    cpu = HostInfo(gpus=(), cpu_count=2, source="none")
    assert fitcheck.check_launch({"model": "llama-3.1-70b", "strategy": "ddp"}, resolve(LaunchOptions(gpus=2), cpu), cpu) is None


@pytest.mark.unit
@pytest.mark.parametrize("plan, match", [
    ({"strategy": "fsdp"}, "at least 'model'"),
    ("llama-3.1-8b", "takes a dict"),
    ({"model": "llama-3.1-8b", "seqlen": 4096}, r"unknown key\(s\) \['seqlen'\]"),
    ({"model": "llama-3.1-8b", "gpus_per_node": 4}, "launch's own GPUs"),
    ({"model": "llama-3.1-8b", "strategy": "fsdp3"}, "use one of"),
    ({"model": "llama-3.1-8b", "on_fail": "ignore"}, "'raise' or 'warn'"),
])
def test_bad_plan_is_refused_at_decoration(plan, match):
    with pytest.raises(ConfigurationError, match=match):
        distributed(gpus=2, plan=plan)(lambda: None)


@pytest.mark.unit
def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ConfigurationError, match="unknown model 'llama-9'"):
        verdict({"model": "llama-9", "strategy": "ddp"})


def test_plan_survives_with_overrides_and_cpu_launch_runs(gpulaunch_home):
    f = distributed(gpus=2, plan={"model": "llama-3.1-70b", "strategy": "ddp"})(lambda: 7)
    assert f.with_overrides(timeout=60).plan == f.plan
    # this host has no GPU: the plan is not checked and the CPU workers run
    assert f.distributed() == [7, 7]


def test_cli_plan_parsing_and_bad_input():
    assert fitcheck.validate({"model": "x"}) == {"model": "x"}
    from gpulaunch.caller.fitcheck import parse_plan as _parse_plan
    assert _parse_plan("model=llama-3.1-8b,strategy=fsdp,seq_len=4096,activation-checkpointing=true") == {
        "model": "llama-3.1-8b", "strategy": "fsdp", "seq_len": 4096, "activation_checkpointing": True}
    proc = subprocess.run([PY, "-m", "gpulaunch.cli", "run", "--plan", "model", "--", "true"],
                          env=python_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "KEY=VALUE" in proc.stderr
