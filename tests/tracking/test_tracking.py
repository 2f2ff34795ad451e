"""MLflow tracking (issue 7): every launch is one MLflow run in a real sqlite store, written by
real ranks (plain mlflow, the HF Trainer, Lightning), closed by the caller with the outcome."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from conftest import assert_no_survivors, latest_run_dir

mlflow = pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402

import gpulaunch.tracking  # noqa: E402
from gpulaunch import cli, distributed  # noqa: E402
from gpulaunch import runtime as rt  # noqa: E402
from gpulaunch.common.rundir import RunDir  # noqa: E402
from gpulaunch.tracking import caller as tracking_caller  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module (a fresh store's schema migration takes seconds)."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_experiment("tests", artifact_location=(root / "artifacts").as_uri())
    return uri


@pytest.fixture
def tracked(monkeypatch, store):
    """Tracking on (conftest turns it off for the rest of the suite), into the module store."""
    monkeypatch.setenv("GPULAUNCH_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tests")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("GPULAUNCH_SYSTEM_METRICS_INTERVAL", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    tracking_caller._warned.clear()
    return FlushingClient(store)


class FlushingClient:
    """An MlflowClient that first waits for the runs' ends, which gpulaunch finishes in a
    background thread after the call returned (``gpulaunch.tracking.flush``)."""

    def __init__(self, uri: str):
        self._client = MlflowClient(uri)

    def __getattr__(self, name):
        assert gpulaunch.tracking.flush(timeout=120), "a run's end is still pending"
        return getattr(self._client, name)


def _tracking_json(run_dir) -> dict:
    gpulaunch.tracking.flush(timeout=120)
    with open(os.path.join(run_dir, "tracking.json")) as f:
        return json.load(f)


def _artifacts(client, run_id, path=None) -> dict[str, int]:
    out = {}
    for f in client.list_artifacts(run_id, path):
        if f.is_dir:
            out.update(_artifacts(client, run_id, f.path))
        else:
            out[f.path] = f.file_size
    return out


def _runs_in(client, name):
    exp = client.get_experiment_by_name(name)
    return client.search_runs([exp.experiment_id]) if exp else []


def _cli(capsys, *argv) -> str:
    capsys.readouterr()
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


# --------------------------------------------------------------------------- plain mlflow
def _log_loss(steps):
    import mlflow
    import torch
    from tqdm import tqdm

    from gpulaunch.parallel import prepare
    rt.init()
    prepare(torch.nn.Linear(4, 4), lambda params: torch.optim.SGD(params, lr=0.1), strategy="ddp")
    for step in tqdm(range(steps), disable=not rt.is_main(), mininterval=0, desc="train"):
        if rt.is_main():
            mlflow.log_metric("loss", 1.0 / (step + 1), step=step)
    print(f"rank {rt.get_global_rank()} finished; run {os.environ.get('GPULAUNCH_MLFLOW_RUN_ID')}")
    return rt.get_global_rank()


def test_two_rank_run_is_one_mlflow_run(monkeypatch, tracked, gpulaunch_home, capsys):
    # The default store: nothing configured -> sqlite under GPULAUNCH_HOME.
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    monkeypatch.delenv("GPULAUNCH_QUIET")
    results = distributed(gpus=2)(_log_loss).distributed(10)
    out, err = capsys.readouterr()
    assert results == [0, 1]                      # nothing injected into the results

    run_dir = latest_run_dir(gpulaunch_home)
    info = _tracking_json(run_dir)
    uri = f"sqlite:///{(gpulaunch_home / 'mlflow.db').resolve()}"
    assert info["tracking_uri"] == uri and info["status"] == "FINISHED"
    client = FlushingClient(uri)
    runs = _runs_in(client, "gpulaunch")
    assert [r.info.run_id for r in runs] == [info["run_id"]]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith((gpulaunch_home / "mlartifacts").resolve().as_uri())
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(10))
    assert min(m.value for m in history) == pytest.approx(0.1)
    p = run.data.params
    assert p["gpulaunch.world_size"] == "2" and p["gpulaunch.device"] == "cpu"
    assert p["gpulaunch.function"] == "_log_loss" and p["gpulaunch.run_dir"] == str(run_dir)
    assert p["version.torch"] and p["version.mlflow"] == mlflow.__version__
    assert p["gpulaunch.strategy"] == "ddp" and p["gpulaunch.mixed_precision"] == "fp32"
    # System metrics from the node agent (CPU workers: no GPU keys).
    cpu = client.get_metric_history(run.info.run_id, "system/node_0/cpu_utilization_percentage")
    assert len(cpu) >= 1          # start and end samples merge if the run ends before the first
    assert "system/node_0/system_memory_usage_megabytes" in run.data.metrics
    assert not any("gpu_" in k for k in run.data.metrics)
    # Logs and the run's own files as artifacts; both ranks saw the run id.
    arts = _artifacts(client, run.info.run_id)
    for r in (0, 1):
        assert arts.get(f"logs/attempt0/rank{r}.log", 0) > 0
        text = client.download_artifacts(run.info.run_id, f"logs/attempt0/rank{r}.log")
        assert f"rank {r} finished; run {run.info.run_id}" in open(text).read()
    assert {"gpulaunch/status.json", "gpulaunch/launch.json", "metrics.png"} <= set(arts)
    assert (run_dir / "metrics.png").stat().st_size > 1000
    assert json.loads((run_dir / "tracking.json").read_text())["run_id"] == run.info.run_id
    # The caller printed where to look, and rank 0's tqdm came through as whole lines.
    assert f"MLflow run {run.info.run_id}" in out and f"mlflow ui --backend-store-uri {uri}" in out
    assert "\r" not in out and "\r" not in err
    # tqdm writes to stderr: shown on the caller's stderr, as under torchrun
    bars = [line for line in err.splitlines() if line.startswith("[rank 0] train:")]
    assert bars and "100%" in bars[-1] and "10/10" in bars[-1]
    assert len(bars) < 10                         # not one line per redraw
    assert not any(line.startswith("[rank 1] train:") for line in out.splitlines())
    assert_no_survivors(run_dir)

    # gpulaunch runs / logs show it.
    listing = _cli(capsys, "runs", "--long")
    row = next(line for line in listing.splitlines() if run_dir.name in line)
    assert re.search(r"_log_loss\s+\S+ \S+\s+[\d.]+s\s+2\s+SUCCEEDED\s+" + run.info.run_id, row)
    logs = _cli(capsys, "logs", run_dir.name, "--rank", "1")
    assert f"rank 1 finished; run {run.info.run_id}" in logs
    followed = _cli(capsys, "logs", run_dir.name, "--follow")     # ends: the run is over
    assert f"[rank 0] rank 0 finished; run {run.info.run_id}" in followed
    assert f"[rank 1] rank 1 finished; run {run.info.run_id}" in followed


FAILING_SCRIPT = """
import os
rank = int(os.environ["RANK"])
print(f"rank {rank} started", flush=True)
import mlflow
if rank == 0:
    mlflow.log_metric("progress", 1.0)
if rank == 1:
    raise ValueError("rank 1 gives up")
"""


def test_failing_script_run_is_failed_with_logs(tracked, gpulaunch_home, tmp_path, capsys):
    script = tmp_path / "fails.py"
    script.write_text(FAILING_SCRIPT)
    capsys.readouterr()
    assert cli.main(["run", "--gpus", "2", "--run-name", "fails-on-1", str(script),
                     "--token", "tok-s3cr3t"]) == 1
    assert "rank 1 raised ValueError: rank 1 gives up" in capsys.readouterr().err
    run_dir = latest_run_dir(gpulaunch_home)
    run_id = _tracking_json(run_dir)["run_id"]
    run = tracked.get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["gpulaunch.state"] == "FAILED"
    assert run.info.run_name == "fails-on-1" and run.data.params["gpulaunch.entry"] == "script"
    assert run.data.tags["mlflow.source.name"].endswith("fails.py --token ***")  # masked (#17)
    assert not [k for k, v in {**run.data.tags, **run.data.params}.items() if "s3cr3t" in v]
    arts = _artifacts(tracked, run_id)
    assert arts.get("logs/attempt0/rank0.log", 0) > 0 and arts.get("logs/attempt0/rank1.log", 0) > 0
    report = open(tracked.download_artifacts(run_id, "gpulaunch/error.txt")).read()
    assert "ValueError: rank 1 gives up" in report
    assert "gpulaunch/status.json" in arts
    assert_no_survivors(run_dir)
    row = next(line for line in _cli(capsys, "runs").splitlines() if run_dir.name in line)
    assert "fails.py" in row and row.rstrip().endswith("FAILED")
    assert "rank 1 gives up" in _cli(capsys, "logs", run_dir.name)


def _env_of_rank():
    return {k: os.environ.get(k) for k in ("MLFLOW_RUN_ID", "GPULAUNCH_MLFLOW_RUN_ID")}


def test_nested_under_active_run_and_switched_off(tracked, gpulaunch_home):
    with mlflow.start_run(experiment_id=tracked.get_experiment_by_name("tests").experiment_id) \
            as parent:
        handle = distributed(gpus=1)(_env_of_rank).submit()
        env = handle.result(timeout=300)[0]
        assert mlflow.active_run().info.run_id == parent.info.run_id   # the caller's is intact
    child = tracked.get_run(handle.mlflow_run_id)
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.experiment_id == parent.info.experiment_id
    assert env == {"MLFLOW_RUN_ID": handle.mlflow_run_id,
                   "GPULAUNCH_MLFLOW_RUN_ID": handle.mlflow_run_id}
    assert child.info.status == "FINISHED"

    before = len(_runs_in(tracked, "tests"))
    off = distributed(gpus=1, tracking=False)(_env_of_rank).submit()
    assert off.result(timeout=300) == [{"MLFLOW_RUN_ID": None, "GPULAUNCH_MLFLOW_RUN_ID": None}]
    assert off.mlflow_run_id is None and not os.path.exists(os.path.join(off.run_dir,
                                                                         "tracking.json"))
    assert len(_runs_in(tracked, "tests")) == before


def _sleep_forever():
    print("sleeping", flush=True)
    time.sleep(600)


def test_cancelled_run_is_killed(tracked, gpulaunch_home):
    handle = distributed(gpus=1)(_sleep_forever).submit()
    run_id = handle.mlflow_run_id
    deadline = time.monotonic() + 120
    while "sleeping" not in handle.logs(0) and time.monotonic() < deadline:
        time.sleep(0.1)
    handle.cancel()
    from gpulaunch.errors import RunCancelledError
    with pytest.raises(RunCancelledError):
        handle.result(timeout=120)
    run = tracked.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["gpulaunch.state"] == "CANCELLED"
    assert "sleeping" in open(tracked.download_artifacts(run_id, "logs/attempt0/rank0.log")).read()
    assert_no_survivors(handle.run_dir)


def test_unreachable_store_costs_a_warning_not_the_run(monkeypatch, tracked, gpulaunch_home,
                                                       capfd):
    # Nothing listens on port 9: MLflow's HTTP client retries with backoff for minutes.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("GPULAUNCH_TRACKING_TIMEOUT", "3")
    handle = distributed(gpus=1)(_env_of_rank).submit()
    assert handle.result(timeout=300) == [{"MLFLOW_RUN_ID": None, "GPULAUNCH_MLFLOW_RUN_ID": None}]
    assert handle.mlflow_run_id is None
    assert _tracking_json(handle.run_dir) == {"disabled": True}
    assert "MLflow tracking:" in capfd.readouterr().err
    assert_no_survivors(handle.run_dir)


def test_tracking_true_without_mlflow_is_a_clear_error(monkeypatch):
    from gpulaunch.errors import ConfigurationError
    from gpulaunch.tracking import settings
    monkeypatch.setattr(settings, "mlflow_installed", lambda: False)
    monkeypatch.delenv("GPULAUNCH_TRACKING")
    with pytest.raises(ConfigurationError, match=r"gpulaunch\[mlflow\]"):
        settings.enabled(settings.normalize(True))
    assert settings.enabled(settings.normalize(None)) is False   # default: quietly off
    with pytest.raises(ConfigurationError, match="tracking="):
        distributed(gpus=1, tracking=3.5)(_env_of_rank)
    with pytest.raises(ConfigurationError, match=r"gpulaunch\[mlflow\]"):
        distributed(gpus=1, tracking=True)(_env_of_rank)     # at decoration, not at launch
    monkeypatch.setenv("GPULAUNCH_TRACKING", "0")                 # the switch beats tracking=True
    assert settings.enabled(settings.normalize(True)) is False


def test_node_sampler_logs_start_and_end_samples(tracked, monkeypatch):
    from gpulaunch.tracking.system import NodeSampler, SystemMetricsLogger
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    sample = NodeSampler(3).sample()
    assert {"system/node_3/cpu_utilization_percentage",
            "system/node_3/system_memory_usage_percentage",
            "system/node_3/ranks_memory_rss_megabytes"} <= set(sample)
    assert 0 <= sample["system/node_3/system_memory_usage_percentage"] <= 100
    run = tracked.create_run(tracked.get_experiment_by_name("tests").experiment_id)
    logger = SystemMetricsLogger(run.info.run_id, tracked.tracking_uri, 3, 30.0).start()
    deadline = time.monotonic() + 120
    while logger.samples < 1 and time.monotonic() < deadline:    # the first, at once
        time.sleep(0.05)
    logger.stop(timeout=120)                                       # and the last, at stop
    hist = tracked.get_metric_history(run.info.run_id, "system/node_3/cpu_utilization_percentage")
    assert [m.step for m in hist] == [0, 1]       # one at start, one at stop; no 30 s wait


def _noop():
    return 0


def test_short_launch_keeps_its_system_metrics_without_waiting_for_the_agent(tracked,
                                                                            gpulaunch_home):
    """A run shorter than the agent's MLflow import: the agent hands its start and end samples
    to the caller (system_metrics.node0.json) instead of waiting; they still land in the run."""
    handle = distributed(gpus=1)(_noop).submit()
    assert handle.result(timeout=120) == [0]
    run_id = handle.mlflow_run_id
    hist = tracked.get_metric_history(run_id, "system/node_0/cpu_utilization_percentage")
    assert [m.step for m in sorted(hist, key=lambda m: m.step)] == [0, 1]   # start and end
    assert "system/node_0/system_memory_usage_megabytes" in tracked.get_run(run_id).data.metrics
    handed = os.path.join(handle.run_dir, "system_metrics.node0.json")
    if os.path.exists(handed):          # the usual path for a no-op: the caller logged these
        with open(handed) as f:
            data = json.load(f)
        assert data["run_id"] == run_id and [s["step"] for s in data["samples"]] == [0, 1]


# --------------------------------------------------------------------------- HF and Lightning
def _hf_train(out_dir):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 16))]
    args = TrainingArguments(output_dir=out_dir, use_cpu=True, max_steps=4, logging_steps=1,
                             per_device_train_batch_size=2, report_to="mlflow", save_strategy="no",
                             disable_tqdm=True, run_name="hf-tiny-llama")
    Trainer(model=model, args=args, train_dataset=data).train()
    return rt.get_global_rank()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hf_trainer_reports_into_gpulaunch_run(tracked, gpulaunch_home, tmp_path, capsys):
    before = {r.info.run_id for r in _runs_in(tracked, "tests")}
    assert distributed(gpus=2)(_hf_train).distributed(str(tmp_path / "hf")) == [0, 1]
    run_dir = latest_run_dir(gpulaunch_home)
    run_id = _tracking_json(run_dir)["run_id"]
    assert {r.info.run_id for r in _runs_in(tracked, "tests")} - before == {run_id}
    run = tracked.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(tracked.get_metric_history(run_id, "loss")) == 4      # logging_steps=1, 4 steps
    assert run.data.params["max_steps"] == "4"                       # HF's own parameters
    assert run.data.params["gpulaunch.world_size"] == "2"
    assert "_hf_train" in next(line for line in _cli(capsys, "runs").splitlines()
                               if run_dir.name in line)


def _lightning_train():
    import lightning.pytorch as pl
    import torch

    from gpulaunch.tracking import mlflow_logger

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters({"width": 8})
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6,
                         log_every_n_steps=1, logger=mlflow_logger(), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    return trainer.logger.run_id


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lightning_mlflow_logger_writes_into_gpulaunch_run(tracked, gpulaunch_home, capsys):
    before = {r.info.run_id for r in _runs_in(tracked, "tests")}
    ids = distributed(gpus=2)(_lightning_train).distributed()
    run_dir = latest_run_dir(gpulaunch_home)
    run_id = _tracking_json(run_dir)["run_id"]
    assert ids[0] == run_id
    assert {r.info.run_id for r in _runs_in(tracked, "tests")} - before == {run_id}
    run = tracked.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(tracked.get_metric_history(run_id, "train_loss")) == 6
    assert run.data.params["width"] == "8"
    assert "_lightning_train" in next(line for line in _cli(capsys, "runs").splitlines()
                                      if run_dir.name in line)
    _cli(capsys, "logs", run_dir.name, "--rank", "0")


def _crash_once_then_log(steps: int):
    import os
    import time

    import mlflow
    import torch.distributed as dist

    from gpulaunch import runtime as rt
    rt.init()
    if rt.get_restart_count() == 0 and rt.get_global_rank() == 1:
        time.sleep(2.5)            # the agent's sampler is logging (every 1 s) when we go
        os._exit(3)
    dist.barrier()                 # attempt 0: rank 0 never gets past this
    if rt.get_global_rank() == 0:
        for i in range(steps):
            mlflow.log_metric("loss", 1.0 / (i + 1), step=i)
    return rt.get_restart_count()


def test_restart_while_the_sampler_logs_is_one_finished_run(tracked, gpulaunch_home):
    """A restart re-forks the ranks while the agent's system-metrics thread talks to MLflow:
    the fork must wait for it (procutil.FORK_QUIET), and the restarted group must log into the
    same run, which ends FINISHED with the system samples of both attempts."""
    fn = distributed(gpus=2, stream_logs="none", max_restarts=1, timeout=240)(
        _crash_once_then_log)
    handle = fn.submit(5)
    assert handle.result(timeout=240) == [1, 1]
    run = tracked.get_run(handle.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in tracked.get_metric_history(run.info.run_id, "loss")] == list(range(5))
    cpu = tracked.get_metric_history(run.info.run_id, "system/node_0/cpu_utilization_percentage")
    assert len(cpu) >= 3                      # samples before, across and after the restart
    assert RunDir(handle.run_dir).status().attempt == 1
