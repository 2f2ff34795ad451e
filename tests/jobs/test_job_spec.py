"""The job spec: reading, checking and the errors a user sees (no process starts here)."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from gpulaunch.jobs import resolve
from gpulaunch.jobs.spec import JobSpec, launch_keys
from gpulaunch.jobs.specfile import SpecError

pytestmark = pytest.mark.unit

GOOD = """\
name: finetune
compute:
  gpus: 2
command:
  script: train.py
  args: ["--lr", "3e-4"]
environment:
  env:
    SEED: 7
    DEBUG: true
retry:
  max_retries: 2
  backoff: 1
launch:
  timeout: 3600
  hang_timeout: 300
tracking:
  experiment: jobs-test
  tags: {team: nlp}
"""


def _spec(tmp_path, text: str, overrides=()) -> JobSpec:
    (tmp_path / "train.py").write_text("print('hi')\n")
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text))
    return resolve.load(path, overrides)


def _error(tmp_path, text: str, overrides=()) -> str:
    with pytest.raises(SpecError) as e:
        _spec(tmp_path, text, overrides)
    return str(e.value)


def test_a_good_spec_reads_into_typed_sections(tmp_path):
    spec = _spec(tmp_path, GOOD)
    assert spec.name == "finetune" and spec.compute.gpus == 2 and spec.compute.where == "local"
    assert spec.command.kind == "script" and spec.command.args == ["--lr", "3e-4"]
    assert spec.environment.env == {"SEED": "7", "DEBUG": "true"}     # numbers written bare
    assert spec.retry.max_retries == 2 and spec.retry.pause(1) == 1.0 and spec.retry.pause(3) == 4
    assert spec.code_dir == tmp_path.resolve()
    opts = resolve.options_for(spec, tracking_tags={"gpulaunch.job": "j"})
    assert (opts.gpus, opts.timeout, opts.hang_timeout) == (2, 3600.0, 300.0)
    assert opts.env == (("DEBUG", "true"), ("SEED", "7"))
    assert opts.tracking.experiment == "jobs-test"
    assert opts.tracking.tags == {"team": "nlp", "gpulaunch.job": "j"}
    assert resolve.entry_for(spec).argv == ("train.py", "--lr", "3e-4")
    # a round trip through the job folder's JSON gives the same spec
    assert JobSpec.from_json(spec.to_json()) == spec


def test_unknown_key_names_its_line_and_the_close_match(tmp_path):
    msg = _error(tmp_path, GOOD.replace("  gpus: 2", "  gpu: 2"))
    assert "job.yaml:3: compute.gpu: unknown key; did you mean 'gpus'?" in msg, msg


def test_wrong_type_names_key_line_and_expected_type(tmp_path):
    msg = _error(tmp_path, GOOD.replace("gpus: 2", "gpus: two"))
    assert "job.yaml:3: compute.gpus: expected an integer, got 'two'" in msg, msg
    msg = _error(tmp_path, GOOD.replace("max_retries: 2", "max_retries: -1"))
    assert "job.yaml:12: retry.max_retries: must be 0 or more (got -1)" in msg, msg


def test_missing_script_is_refused_before_anything_starts(tmp_path):
    msg = _error(tmp_path, GOOD.replace("script: train.py", "script: nope.py"))
    assert "job.yaml:5: command.script: 'nope.py' is not a file under code.dir" in msg, msg


def test_impossible_gpu_count_for_this_host(tmp_path, monkeypatch):
    monkeypatch.setenv("GPULAUNCH_MAX_CPU_WORKERS", "4")
    msg = _error(tmp_path, GOOD.replace("gpus: 2", "gpus: 64"))
    assert "job.yaml:3: compute.gpus: gpus=64 was requested, but this host has no GPU" in msg
    msg = _error(tmp_path, GOOD.replace("gpus: 2", "gpus: 2\n  gpu_type: H100"))
    assert "job.yaml:4: compute.gpu_type: gpu_type=H100 was requested" in msg, msg


def test_launch_section_takes_launch_options_fields_only(tmp_path):
    keys = launch_keys()
    assert {"timeout", "hang_timeout", "max_restarts", "plan", "stream_logs"} <= set(keys)
    assert not {"gpus", "env", "tracking", "keep_alive"} & set(keys)
    msg = _error(tmp_path, GOOD.replace("timeout: 3600", "timeout: -5"))
    assert "job.yaml:15: launch.timeout:" in msg and "-5" in msg, msg
    msg = _error(tmp_path, GOOD.replace("timeout: 3600", "gpus: 4"))
    assert "launch.gpus: set compute.gpus instead" in msg, msg
    msg = _error(tmp_path, GOOD.replace("timeout: 3600", "keep_alive: true"))
    assert "launch.keep_alive: not for jobs" in msg, msg
    msg = _error(tmp_path, GOOD.replace("timeout: 3600", "timeuot: 5"))
    assert "launch.timeuot: unknown key; did you mean 'timeout'?" in msg, msg


def test_tracking_section_takes_tracking_fields(tmp_path):
    msg = _error(tmp_path, GOOD.replace("experiment: jobs-test", "experimnt: x"))
    assert "job.yaml:18: tracking.experimnt: unknown key; did you mean 'experiment'?" in msg
    msg = _error(tmp_path, GOOD.replace("experiment: jobs-test",
                                        "system_metrics_interval: -1"))
    assert "tracking.system_metrics_interval:" in msg, msg


def test_command_needs_exactly_one_kind(tmp_path):
    msg = _error(tmp_path, GOOD.replace("  script: train.py", "  script: train.py\n"
                                                                "  module: pkg.train"))
    assert "command: give exactly one of script:, module: or function: (got script and " \
           "module)" in msg, msg
    msg = _error(tmp_path, GOOD.replace("script: train.py", "function: train"))
    assert "command.function: write 'module:function'" in msg, msg


def test_missing_name_and_several_nodes_on_this_host(tmp_path):
    assert "name: is missing" in _error(tmp_path, GOOD.replace("name: finetune\n", ""))
    msg = _error(tmp_path, GOOD.replace("gpus: 2", "gpus: 2\n  nodes: 2"))
    assert "compute.nodes: 2 nodes with where: local" in msg, msg


def test_overrides_change_values_and_are_named_in_errors(tmp_path):
    spec = _spec(tmp_path, GOOD, ["compute.gpus=1", "launch.max_restarts=3",
                                  "environment.env.EXTRA=x", "retry.backoff=0.5"])
    assert spec.compute.gpus == 1 and spec.launch["max_restarts"] == 3
    assert spec.environment.env["EXTRA"] == "x" and spec.retry.backoff == 0.5
    msg = _error(tmp_path, GOOD, ["compute.gpus=many"])
    assert "--override compute.gpus: expected an integer" in msg, msg
    msg = _error(tmp_path, GOOD, ["name.x=1"])
    assert "--override name.x: name is str 'finetune', not a section" in msg, msg
    with pytest.raises(SpecError, match="KEY=VALUE"):
        _spec(tmp_path, GOOD, ["compute.gpus"])


def test_yaml_syntax_errors_and_duplicate_keys(tmp_path):
    assert "not valid YAML" in _error(tmp_path, "name: [unclosed\n")
    msg = _error(tmp_path, GOOD + "name: again\n")
    assert "name is given twice" in msg, msg


def test_every_section_field_is_documented():
    from gpulaunch.jobs import spec as spec_module
    for cls in (spec_module.JobSpec, spec_module.Compute, spec_module.SlurmCompute,
                spec_module.RayCompute, spec_module.Environment, spec_module.Code,
                spec_module.Command, spec_module.Retry):
        assert cls.__doc__
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"


def test_rank_filter_reads_both_launch_prefixes():
    from gpulaunch.jobs.follow import _keep
    assert _keep("[rank 1] loss 2.0", 1) == "loss 2.0"
    assert _keep("[node 0 rank 1] loss 2.0", 1) == "loss 2.0"       # a launch over Ray
    assert _keep("[rank 11] loss", 1) is None and _keep("gpulaunch: run x", 1) is None
    assert _keep("GPULAUNCH_ATTEMPT_RESULT {}", None) is None


def test_a_long_cause_keeps_its_head_and_tail_and_says_where_the_rest_is():
    from gpulaunch.jobs.targets import bounded_cause
    assert bounded_cause("short", "the log") == "short"
    text = "runtime_env setup failed\n" + "x" * 100_000 + "\nERROR: No space left on device"
    cut = bounded_cause(text, "the attempt's log", limit=400)
    assert cut.startswith("runtime_env setup failed") and cut.endswith("No space left on device")
    assert len(cut) < 600 and "characters left out" in cut and "the attempt's log" in cut
