"""Every recipe runs end to end as a script at its tiny CPU settings (2 ranks, real gloo) and
learns: the metric it returns moved the right way. One recipe also runs as a notebook in a
real Jupyter kernel. The thresholds come from runs with several seeds (recipes/README.md)."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
from conftest import PY, ROOT, assert_no_survivors, latest_run_dir, python_env

RECIPES = ROOT / "recipes"
pytestmark = pytest.mark.slow


def run_recipe(name: str, cwd, *args: str, timeout: float = 840) -> dict:
    """Run recipes/<name>.py as a script in `cwd`; return the result JSON it wrote."""
    out = cwd / f"{name}-{len(list(cwd.glob(f'{name}-*.json')))}.json"
    env = python_env({"MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1",
                      "GPULAUNCH_QUIET": ""})
    proc = subprocess.run([PY, str(RECIPES / f"{name}.py"), "--out", str(out), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{name} failed (exit {proc.returncode})\n--- stdout\n"
                                  f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["_stdout"] = proc.stdout
    return result


def mlflow_metric(uri: str, run_id: str, key: str) -> list:
    from mlflow.tracking import MlflowClient
    return MlflowClient(uri).get_metric_history(run_id, key)


def test_mlp_ddp_loss_halves_and_logs_to_mlflow(tmp_path, gpulaunch_home):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    r = run_recipe("pytorch_mlp_ddp", tmp_path, "--mlflow-uri", uri)
    assert r["world_size"] == 2 and r["device"] == "cpu"
    assert r["after"] <= 0.5 * r["before"], (r["before"], r["after"])
    assert "held-out MSE before training" in r["_stdout"]  # rank 0's log reached the caller
    assert_no_survivors(latest_run_dir(gpulaunch_home))
    # rank 0 logged every tracked loss to the MLflow store
    from mlflow.tracking import MlflowClient
    runs = MlflowClient(uri).search_runs(
        [MlflowClient(uri).get_experiment_by_name("gpulaunch-recipes").experiment_id])
    assert len(runs) == 1
    history = mlflow_metric(uri, runs[0].info.run_id, "loss")
    assert [m.step for m in history] == [s for s, _ in r["loss_history"]]
    assert runs[0].data.metrics["eval_mse_after"] == pytest.approx(r["after"])


def test_transformer_fsdp_loss_falls_and_resumes_exactly(tmp_path, gpulaunch_home):
    # the seed's architecture at a smaller width so three runs fit in CI time
    small = ["--dim", "128", "--blocks", "2", "--log-every", "2", "--ckpt-every", "6"]
    ckpt, fresh = str(tmp_path / "ckpt"), str(tmp_path / "ckpt-uninterrupted")
    first = run_recipe("pytorch_transformer_fsdp", tmp_path, *small, "--steps", "12",
                       "--ckpt-dir", ckpt)
    assert first["strategy"] == "fsdp" and first["world_size"] == 2
    assert first["params_on_rank0"] < first["parameters"]  # sharded, not replicated
    assert first["resumed_from"] is None and first["final_step"] == 12
    assert first["after"] < first["before"] - 0.1, (first["before"], first["after"])
    assert [c.rsplit("/", 1)[-1] for c in first["checkpoints"]] == ["step_00000006",
                                                                     "step_00000012"]

    second = run_recipe("pytorch_transformer_fsdp", tmp_path, *small, "--steps", "18",
                        "--ckpt-dir", ckpt)
    assert second["resumed_from"] == 12 and second["final_step"] == 18
    # the model came back exactly as it was saved ...
    assert second["before"] == pytest.approx(first["after"], abs=1e-6)
    # ... and so did the optimizer, the data position and the RNG: the resumed run's losses
    # are those of a run that never stopped
    whole = run_recipe("pytorch_transformer_fsdp", tmp_path, *small, "--steps", "18",
                       "--ckpt-dir", fresh)
    resumed = dict(map(tuple, second["loss_history"]))
    straight = {s: v for s, v in map(tuple, whole["loss_history"]) if s > 12}
    assert resumed.keys() == straight.keys() == {14, 16, 18}
    for s in straight:
        assert resumed[s] == pytest.approx(straight[s], rel=1e-4, abs=1e-5), s
    assert second["after"] == pytest.approx(whole["after"], rel=1e-4)
    assert_no_survivors(latest_run_dir(gpulaunch_home))


def test_retinanet_ddp_trains_from_scratch(tmp_path, gpulaunch_home):
    pytest.importorskip("torchvision")
    r = run_recipe("pytorch_retinanet_ddp", tmp_path, "--data-root", str(tmp_path / "data"))
    assert r["world_size"] == 2
    assert r["lr"] == pytest.approx(0.04 * 2 * 2 / 64)  # scaled with the global batch
    assert r["loss_last"] < 0.9 * r["loss_first"], (r["loss_first"], r["loss_last"])
    assert all(math.isfinite(v) for v in r["loss_history"])
    assert 0.0 <= r["before"] <= 0.01 and r["after"] >= 0.0  # mAP is computed, before and after
    # the generated dataset is a real COCO folder, and the node-local copy was removed
    coco = json.loads(next((tmp_path / "data").glob("*/annotations/instances_train.json"))
                      .read_text())
    assert len(coco["images"]) == 64 and coco["annotations"] and len(coco["categories"]) == 3
    assert_no_survivors(latest_run_dir(gpulaunch_home))


def test_retinanet_rejects_a_bad_coco_folder_before_launching(tmp_path):
    proc = subprocess.run([PY, str(RECIPES / "pytorch_retinanet_ddp.py"),
                           "--coco-dir", str(tmp_path / "nowhere")], cwd=tmp_path,
                          env=python_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "instances_train.json" in proc.stderr and "nowhere" in proc.stderr
    assert "gpulaunch: run" not in proc.stdout  # nothing was started


def test_lightning_two_tower_joins_the_launch_and_learns(tmp_path, gpulaunch_home):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    r = run_recipe("lightning_two_tower_ddp", tmp_path, "--mlflow-uri", uri,
                   "--embeddings", "nn")
    # Lightning used the processes gpulaunch started instead of spawning its own
    assert r["cluster_environment"] == "TorchElasticEnvironment" and r["world_size"] == 2
    assert r["after"] > 0.7 and r["test_auroc"] > 0.7, r
    assert r["before"] < 0.6
    assert (tmp_path / "checkpoints" / "lightning_two_tower").is_dir()
    assert r["best_model_path"].endswith(".ckpt") and f"{r['after']:.4f}" in r["best_model_path"]
    aurocs = mlflow_metric(uri, r["mlflow_run_id"], "val_auroc")
    assert max(m.value for m in aurocs) == pytest.approx(r["after"], abs=1e-4)
    assert_no_survivors(latest_run_dir(gpulaunch_home))


def test_lightning_two_tower_with_torchrec(tmp_path, gpulaunch_home):
    if os.environ.get("CI"):
        import torchrec  # noqa: F401 - CI installs it (scripts/venv.sh): a skip there hides a break
    else:
        pytest.importorskip("torchrec", reason="TorchRec is not installed (nn.EmbeddingBag is tested)")
    r = run_recipe("lightning_two_tower_ddp", tmp_path, "--mlflow-uri", "",
                   "--embeddings", "torchrec", "--epochs", "2")
    assert r["embeddings"] == "torchrec" and r["after"] > r["before"] + 0.1, r


def test_mlp_recipe_runs_as_a_notebook_in_a_real_kernel(tmp_path):
    jupytext = pytest.importorskip("jupytext")
    from nbclient import NotebookClient

    nb = jupytext.read(RECIPES / "pytorch_mlp_ddp.py")
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    assert "[rank 0] held-out MSE before training" in text
    assert "held-out MSE" in text and "samples/s" in text
    before, after = (float(text.split(key)[1].split()[0]) for key in
                     ("[rank 0] held-out MSE before training:", "[rank 0] held-out MSE after training:"))
    assert after <= 0.5 * before


def test_quickstart_notebook_matches_its_script():
    jupytext = pytest.importorskip("jupytext")
    py = jupytext.read(RECIPES / "quickstart.py")
    ipynb = jupytext.read(RECIPES / "quickstart.ipynb")
    assert [(c.cell_type, c.source.strip()) for c in py.cells] == \
           [(c.cell_type, c.source.strip()) for c in ipynb.cells], \
        "quickstart.ipynb is out of date: jupytext --sync recipes/quickstart.py"
