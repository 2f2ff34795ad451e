"""Unit tests of the one settings object (no process starts; the file runs in seconds).

Every entry point derives its settings from ``LaunchOptions``: the decorator's keywords, its
``with_overrides``, ``gpulaunch run``'s flags, and the ``LaunchSpec`` the backends get. These
tests read the derived forms against the fields, so a setting added in one place reaches all.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os

import pytest

from gpulaunch import distributed, ray_launch
from gpulaunch.caller.spec import resolve
from gpulaunch.common.records import LaunchSpec
from gpulaunch.errors import ConfigurationError, GPUTypeError, GPUValidationError
from gpulaunch.hardware.catalog import GPUType
from gpulaunch.hardware.host import GPUInfo, HostInfo
from gpulaunch.options import LaunchOptions, add_cli_arguments, build, from_cli

pytestmark = pytest.mark.unit

H200 = HostInfo(gpus=tuple(GPUInfo(i, "NVIDIA H200", 143 << 30) for i in range(8)),
                cpu_count=128, source="nvml")
LAPTOP = HostInfo(gpus=(), cpu_count=8, source="none")


def _cli(*argv: str) -> LaunchOptions:
    p = argparse.ArgumentParser()
    add_cli_arguments(p)
    return from_cli(p.parse_args(list(argv)))


def test_cli_and_decorator_have_the_same_defaults():
    # The first round's CLI had no timeout while the API had 3 h; now both are the fields'.
    assert _cli() == build() == LaunchOptions()
    assert distributed(lambda: 0).options == LaunchOptions()
    assert build().timeout == 3 * 3600


def test_every_setting_is_documented_and_in_the_decorators_signature():
    sig = inspect.signature(distributed)
    for f in dataclasses.fields(LaunchOptions):
        assert f.metadata["doc"], f"{f.name} has no documentation"
        assert f.name in sig.parameters or f.name in ("gpus", "gpu_type"), f.name
    assert list(sig.parameters)[:4] == ["num_accelerators", "accelerator_type", "remote",
                                        "timeout"]          # the seed's positional order


def test_cli_flags_give_the_same_options_as_keywords():
    assert _cli("--gpus", "3", "--timeout", "60", "--hang-timeout", "5", "--max-restarts", "2",
                "--logs", "0,2", "--env", "A=1", "--env", "B=x=y") == \
        build(gpus=3, timeout=60, hang_timeout=5, max_restarts=2, stream_logs=[2, 0],
              env={"A": "1", "B": "x=y"})
    # "none" is a value: it switches the limit off, as timeout=None does.
    assert _cli("--timeout", "none").timeout is None
    # torchrun's words: auto = every GPU (None: resolved at launch), else one rank per core
    from gpulaunch.hardware import host
    assert _cli("--nproc-per-node", "auto").gpus == (None if host.detect().gpus else
                                                      (os.cpu_count() or 1))


def test_with_overrides_can_set_any_setting_back_to_none():
    f = distributed(gpus=2, timeout=30, hang_timeout=4)(lambda: 0)
    g = f.with_overrides(gpus=None, hang_timeout=None)
    assert g.gpus is None and g.hang_timeout is None and g.timeout == 30
    assert f.gpus == 2                                       # the original is unchanged
    assert f.with_overrides(num_accelerators=4).gpus == 4    # aliases too
    assert f.with_overrides(num_accelerators=None).gpus == 2  # the seed's "not given"


def test_bad_settings_are_named_with_what_is_allowed():
    with pytest.raises(ConfigurationError, match=r"unknown settings \['colour', 'size'\]"):
        build(colour="red", size=3)
    with pytest.raises(ConfigurationError, match="either gpus= or num_accelerators="):
        build(gpus=2, num_accelerators=2)
    with pytest.raises(GPUValidationError, match="positive int"):
        build(gpus="two")
    with pytest.raises(ConfigurationError, match="positive number of seconds"):
        build(timeout=-1)
    with pytest.raises(ConfigurationError, match="KEY=VALUE"):
        _cli("--env", "NOEQUALS")
    with pytest.raises(ConfigurationError, match="twice"):
        build(2, gpus=2)


def test_positional_seed_spelling():
    o = build(4, "H100", False, 60)
    assert (o.gpus, o.gpu_type, o.remote, o.timeout) == (4, GPUType.H100, False, 60)
    assert build(None, gpus=2).gpus == 2
    acc = build(accelerator_type="GPU_8xH200")
    assert resolve(acc, H200).nproc_per_node == 8


def test_spec_gets_every_shared_setting_by_name():
    o = build(gpus=2, timeout=7, hang_timeout=3, max_restarts=1, shutdown_grace=2,
              start_timeout=9, node_lost_timeout=11, stream_logs="rank0", env={"X": "1"})
    spec = resolve(o, H200)
    shared = {f.name for f in dataclasses.fields(LaunchSpec)} & \
        {f.name for f in dataclasses.fields(LaunchOptions)}
    for name in shared - {"env", "gpu_type"}:
        assert getattr(spec, name) == getattr(o, name), name
    # one route: hang_timeout travels as a spec field only (the rank environment is built from
    # the spec by backends/local/rank_env.py), env= holds the user's variables alone
    assert dict(spec.env) == {"X": "1"} and spec.hang_timeout == 3.0
    from gpulaunch.backends.local.rank_env import rank_env
    assert rank_env({}, spec)["GPULAUNCH_HANG_TIMEOUT"] == "3.0"
    assert spec.gpu_type == GPUType.H200 and spec.device == "cuda"


def test_resolution_against_the_host():
    assert resolve(build(), H200).nproc_per_node == 8
    cpu = resolve(build(), LAPTOP)
    assert (cpu.device, cpu.nproc_per_node) == ("cpu", 2)
    with pytest.raises(GPUValidationError, match=r"gpus=9 .* 8 GPU"):
        resolve(build(gpus=9), H200)
    with pytest.raises(GPUTypeError, match="NVIDIA H200"):
        resolve(build(gpu_type="A100"), H200)
    with pytest.raises(GPUValidationError, match="explicit gpus="):
        resolve(build(remote=True), LAPTOP)
    assert resolve(build(cluster="ray://head:10001", gpus=16), LAPTOP).remote


def test_ray_launch_takes_the_same_settings():
    f = ray_launch(gpus=2, timeout=5)(lambda: 0)
    assert f.options == build(gpus=2, timeout=5)
    assert set(inspect.signature(ray_launch).parameters) == \
        set(inspect.signature(distributed).parameters)
