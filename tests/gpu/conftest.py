"""Fixtures and rules of the GPU suite (tests/gpu): real CUDA, real NCCL, real processes.

``bash scripts/gpu_suite.sh`` runs it on the lent GPU machine. The rules:

* every test here carries the ``gpu`` marker; on a host without a usable CUDA GPU each one is
  skipped with the reason printed (``-rs``);
* on a GPU host nothing is skipped quietly: nvidia-smi listing GPUs that torch cannot use fails
  every test, and a missing package fails the test that needs it, naming the wheel that was not
  carried (``helpers.require``); a test marked ``gpus(n)`` is skipped on a host with fewer than
  n GPUs, saying how many it has;
* tests/conftest.py forces CPU workers (``GPULAUNCH_FORCE_CPU=1``) for the CPU suite; its
  ``gpulaunch_home`` fixture is overridden here, same run-directory root per test, real GPUs;
* the test process is the caller of every launch and must never initialise CUDA itself
  (test_gpu_zz_caller.py checks that at the end), so nothing here touches torch.cuda beyond
  NVML-based queries.

Records (losses, timings) and per-test outcomes go to ``$GPU_SUITE_OUT`` when it is set.
"""

from __future__ import annotations

import json
import os
import tarfile
import time
from pathlib import Path

import pytest

from .helpers import OUT, gpu_rows, gpu_type_name, host, memory_used_mib

# torch.cuda.is_available()/device_count() through NVML, never cuInit: set before torch is
# imported by anything in this process.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# This workplace's multi-GPU hosts must keep NVLink multicast off (KINDS.md); harmless on one.
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

HERE = Path(__file__).resolve().parent
# The order tests run in: the launcher's basics first (their timings, memory baselines and
# NVML readings are taken on an idle GPU), then the parallel strategies with the recipes
# running beside them, the caller's final CUDA check last.
MODULE_ORDER = ("test_gpu_launch", "test_gpu_failures", "test_gpu_restart", "test_gpu_tracking",
                "test_gpu_parallel", "test_gpu_recipes", "test_gpu_zz_caller")
RECORDS: dict[str, dict] = {}
ARTIFACTS = Path(os.environ.get("GPU_SUITE_ARTIFACTS") or "/tmp/gpu-suite-artifacts")
_SMALL = 1 << 20            # of each file kept from a failed test's runs: its last MiB
_KEEP_TOTAL = 12 << 20      # all kept files together (one file back from the device: <16 MiB)
_kept_bytes = [0]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): needs at least n GPUs on this host")
    config.addinivalue_line("markers", "recipe: a recipe of recipes/, run as a user runs it")


def _in_suite(item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


def _host_verdict() -> tuple[str, str]:
    """("ok" | "skip" | "broken", reason)."""
    h = host()
    smi = h["smi"]
    if h["cuda"]:
        return "ok", ""
    if smi:
        return "broken", (f"nvidia-smi lists {len(smi)} GPU(s) ({smi[0]['name']}) but torch "
                          f"{h['torch']} cannot use them (torch.cuda.is_available() is False"
                          f"{'; ' + h['error'] if h['error'] else ''}): a broken GPU host is a "
                          "failure, not a skip")
    why = "nvidia-smi is not installed" if smi is None else "nvidia-smi lists no GPU"
    if h["error"]:
        why = f"torch did not import ({h['error']})"
    return "skip", (f"no CUDA GPU on this host (torch.cuda.is_available() is False; {why}). "
                    "tests/gpu runs on the lent GPU machine: bash scripts/gpu_suite.sh")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    ours = [i for i, item in enumerate(items) if _in_suite(item)]
    if not ours:
        return
    verdict, reason = _host_verdict()
    count = host()["count"]
    picked = [items[i] for i in ours]
    rank = {name: k for k, name in enumerate(MODULE_ORDER)}
    picked.sort(key=lambda it: rank.get(Path(str(it.path)).stem, len(MODULE_ORDER) - 1))
    for slot, item in zip(ours, picked):
        items[slot] = item
        item.add_marker(pytest.mark.gpu)
        if verdict == "skip":
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        need = item.get_closest_marker("gpus")
        if verdict == "ok" and need is not None and count < need.args[0]:
            item.add_marker(pytest.mark.skip(reason=(
                f"needs {need.args[0]} GPUs; this host has {count}. It runs on a host with "
                f"{need.args[0]} or more (e.g. the nvidia-h200-x{max(2, need.args[0])} kind)")))


@pytest.fixture(autouse=True)
def gpulaunch_home(tmp_path, monkeypatch):
    """Overrides tests/conftest.py's fixture: a private run-directory root per test, as there,
    but real GPUs (no GPULAUNCH_FORCE_CPU). Tracking stays off unless a test turns it on."""
    verdict, reason = _host_verdict()
    if verdict == "broken":
        pytest.fail(reason, pytrace=False)
    monkeypatch.setenv("GPULAUNCH_HOME", str(tmp_path / "gpulaunch-home"))
    monkeypatch.delenv("GPULAUNCH_FORCE_CPU", raising=False)
    monkeypatch.setenv("GPULAUNCH_QUIET", "1")
    monkeypatch.setenv("GPULAUNCH_TRACKING", "0")
    yield tmp_path / "gpulaunch-home"


class GpuHost:
    """The host's GPUs as the test starts, and the GPU memory in use before it launched."""

    def __init__(self):
        self.rows = gpu_rows() or []
        self.count = host()["count"]
        self.name = self.rows[0]["name"] if self.rows else ""
        self.type_name = gpu_type_name(self.name)
        self.baseline_mib = memory_used_mib()


@pytest.fixture
def gpu() -> GpuHost:
    return GpuHost()


@pytest.fixture
def record(request):
    """``record(key=value, ...)``: numbers worth keeping (losses, timings), written to
    $GPU_SUITE_OUT/gpu-records.json under the test's id."""
    entry = RECORDS.setdefault(request.node.nodeid, {})

    def put(**kv):
        entry.update(kv)
    return put


@pytest.fixture
def keep(request):
    """``keep(path)``: a run directory or log to save (small files only) if the test fails."""
    paths: list[Path] = []
    yield lambda p: paths.append(Path(p)) if p else None
    rep = getattr(request.node, "rep_call", None)
    if rep is None or not rep.failed:
        return
    _save_small_files(paths, ARTIFACTS / request.node.nodeid.replace("/", "_")
                      .replace("::", "__")[-120:])


# Tests that need no quiet GPU (no memory baseline, no timings, no NVML readings kept): the
# recipes run beside them. test_gpu_tracking runs before, on an idle GPU.
OVERLAP_RECIPES_WITH = ("test_gpu_parallel",)


@pytest.fixture(scope="session")
def recipes_started(tmp_path_factory):
    """The recipes of recipe_runs.py, started together once; any still running at the end of
    the session is stopped (its own process group, by pid)."""
    from .recipe_runs import Runs
    runs = Runs(tmp_path_factory.mktemp("recipes"))
    yield runs
    runs.stop_all()


@pytest.fixture(autouse=True)
def _recipes_in_background(request):
    """Start the recipes when the first test that may share the GPU with them begins (if any
    recipe test is selected), so that their minutes overlap those tests' instead of adding."""
    if Path(str(request.node.path)).stem in OVERLAP_RECIPES_WITH and any(
            item.get_closest_marker("recipe") for item in request.session.items):
        request.getfixturevalue("recipes_started")


def _save_small_files(paths: list[Path], dest: Path) -> None:
    for src in (p for p in paths if p.exists()):
        files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
        for f in files:
            if f.suffix in (".pt", ".distcp", ".safetensors", ".bin") or \
                    (f.suffix == ".pkl" and not f.name.endswith("nccl_trace.pkl")):
                continue            # weights and payloads: large, and no help in reading a failure
            size = f.stat().st_size
            if _kept_bytes[0] + min(size, _SMALL) > _KEEP_TOTAL:
                return
            target = dest / (f.name if src.is_file() else Path(src.name) / f.relative_to(src))
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(f, "rb") as fin, open(target, "wb") as fout:
                fin.seek(max(0, size - _SMALL))     # a long log: its last MiB
                fout.write(fin.read())
            _kept_bytes[0] += min(size, _SMALL)


def pytest_collection_finish(session):
    """What this run will try, for scripts/gpu_suite.sh's summary: a test cut off by the suite's
    time cap then reads "not run" there instead of vanishing from the list."""
    path = os.environ.get("GPU_SUITE_COLLECTED")
    if path:
        Path(path).write_text("".join(item.nodeid + "\n" for item in session.items))


def pytest_runtest_logreport(report):
    """One JSON line per test phase that matters, written as it happens: the summary is still
    there if the run is cut short (the device call's time limit)."""
    if not OUT or "tests/gpu/" not in report.nodeid:
        return
    if report.when != "call" and not (report.failed or report.skipped):
        return
    line = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
            "seconds": round(report.duration, 2), "time": time.time()}
    if report.skipped and isinstance(report.longrepr, tuple):
        line["reason"] = str(report.longrepr[2])
    elif report.failed:
        line["message"] = report.longreprtext[-3000:]
    with open(Path(OUT) / "gpu-results.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def pytest_sessionfinish(session, exitstatus):
    if not OUT:
        return
    if RECORDS:
        (Path(OUT) / "gpu-records.json").write_text(json.dumps(RECORDS, indent=1, default=str))
    if ARTIFACTS.is_dir() and any(ARTIFACTS.iterdir()):
        with tarfile.open(Path(OUT) / "gpu-artifacts.tar.gz", "w:gz") as tar:
            tar.add(ARTIFACTS, arcname="gpu-artifacts")
