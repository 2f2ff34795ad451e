"""Helpers for the job tests: run the real CLI, wait for a job's state, check that nothing of
a job is left running."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import textwrap
import time
import zipfile
from pathlib import Path

import psutil
from conftest import PY, python_env

# Two gloo ranks; FAIL_RANK=r makes rank r raise; WAIT_FILE makes every rank wait for a file.
SCRIPT = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    r = dist.get_rank()
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t)
    print(f"rank {r} sum {t.item()}", flush=True)
    wait = os.environ.get("WAIT_FILE")
    if wait:
        with open(f"{wait}.rank{r}", "w") as f:
            f.write(str(os.getpid()))
        while not os.path.exists(wait):
            time.sleep(0.1)
    if os.environ.get("FAIL_RANK") == str(r):
        raise ValueError(f"boom on rank {r}")
    print(f"rank {r} done", flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


def write_job(tmp_path: Path, extra: str = "", name: str = "t") -> Path:
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text(SCRIPT)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: {name}\ncompute:\n  gpus: 2\ncode:\n  dir: code\ncommand:\n"
                    f"  script: train.py\n" + textwrap.dedent(extra))
    return spec


def gl(*args, env: dict | None = None, timeout: float = 240, check: bool = True):
    p = subprocess.run([PY, "-m", "gpulaunch.cli", *map(str, args)], env=python_env(env),
                       capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    if check and p.returncode not in (0,):
        raise AssertionError(f"gpulaunch {' '.join(map(str, args))} exited {p.returncode}\n"
                             f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def get(job_id: str) -> dict:
    return json.loads(gl("job", "get", job_id, "--json").stdout)


def wait_for(what: str, cond, timeout: float = 180.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


def wait_state(job_id: str, states=("SUCCEEDED", "FAILED", "CANCELLED"), timeout=240.0):
    return wait_for(f"job {job_id} in {states}",
                    lambda: (lambda d: d if d["state"] in states else None)(get(job_id)),
                    timeout=timeout, every=0.5)


def job_pids(home: Path, job_id: str) -> set[int]:
    """The supervisor, each attempt's process, and every pid its runs recorded."""
    from conftest import run_pids
    job = home / "jobs" / job_id
    rec = json.loads((job / "job.json").read_text())
    pids = {rec["supervisor_pid"]}
    for f in (job / "attempts").glob("*.json"):
        if not f.stem.isdigit():
            continue
        a = json.loads(f.read_text())
        result = f.with_name(f"{f.stem}.result.json")     # the attempt's own, while it runs
        if result.exists():
            a = {**json.loads(result.read_text()), **a}
        if a.get("pid"):
            pids.add(a["pid"])
        if a.get("run_dir") and Path(a["run_dir"]).exists():
            pids |= run_pids(a["run_dir"])
    return pids


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_nothing_left(home: Path, job_id: str, wait: float = 10.0) -> None:
    pids = job_pids(home, job_id)
    assert len(pids) >= 3, f"too few pids recorded to check: {pids}"
    wait_for(f"every process of {job_id} to end ({pids})", lambda: not alive(pids), wait)


def wheel(folder, name: str, version: str, body: str):
    """A pure-Python wheel built by hand (pip installs it offline)."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": body,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path
