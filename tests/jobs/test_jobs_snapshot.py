"""The code snapshot (which files travel, the content hash, the size limit) and a cancel that
must not wait for another job's environment build."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time

import pytest
from conftest import PY
from jobhelp import get, gl, wait_for, write_job

from gpulaunch.jobs import snapshot
from gpulaunch.jobs.specfile import SpecError


def _tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


FILES = {"train.py": "print(1)\n", "pkg/model.py": "x = 1\n", "data/big.bin": "0" * 100,
         "pkg/__pycache__/model.cpython-311.pyc": "junk", "notes.tmp": "scratch",
         "sub/.gitignore": "local.txt\n", "sub/local.txt": "ignored below sub/",
         "sub/kept.txt": "kept", ".gitignore": "data/\n__pycache__/\n*.tmp\n"}
KEPT = [".gitignore", "pkg/model.py", "sub/.gitignore", "sub/kept.txt", "train.py"]


def test_gitignore_is_honoured_outside_git(tmp_path):
    _tree(tmp_path, FILES)
    assert snapshot.list_files(tmp_path) == KEPT
    assert snapshot.list_files(tmp_path, ["sub/"]) == [".gitignore", "pkg/model.py",
                                                        "train.py"]


def test_git_work_tree_uses_gits_own_answer(tmp_path):
    _tree(tmp_path, FILES)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".git" / "info" / "exclude").write_text("sub/kept.txt\n")   # only git knows
    assert snapshot.list_files(tmp_path) == [f for f in KEPT if f != "sub/kept.txt"]


def test_snapshot_is_content_hashed_shared_and_bounded(tmp_path, gpulaunch_home):
    src = tmp_path / "src"
    _tree(src, FILES)
    digest, path, count = snapshot.take(src)
    assert count == len(KEPT) and sorted(
        str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()
        and p.name != snapshot.COMPLETE) == KEPT
    again = snapshot.take(src)
    assert again[:2] == (digest, path)                       # same content, same copy
    (src / "train.py").write_text("print(2)\n")
    changed, other, _ = snapshot.take(src)
    assert changed != digest and (path / "train.py").read_text() == "print(1)\n"
    (src / "huge.bin").write_bytes(b"0" * 2_000_000)
    with pytest.raises(SpecError, match=r"holds 2 MB after .gitignore \(limit code.max_mb=1\); "
                                        r"largest: .*huge.bin"):
        snapshot.take(src, max_mb=1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cancel_does_not_wait_for_another_jobs_environment_build(tmp_path, gpulaunch_home):
    """Another job holds the build lock of the same requirements (here: this test holds it);
    a job waiting for it is cancelled at once, and leaves the lock to its holder."""
    reqs = ["gpulaunch-never-built==1.0"]
    digest = subprocess.run([PY, "-c", "import sys; from gpulaunch.jobs.environment import "
                             f"env_hash; print(env_hash({reqs!r}, sys.executable))"],
                            capture_output=True, text=True, check=True,
                            env={**os.environ}).stdout.strip()
    envs = gpulaunch_home / "envs"
    envs.mkdir(parents=True)
    fd = os.open(envs / f"{digest}.lock", os.O_WRONLY | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        spec = write_job(tmp_path, f"environment:\n  requirements: {json.dumps(reqs)}\n")
        job_id = gl("job", "run", spec).stdout.strip()
        wait_for("the job waiting on the build lock",
                 lambda: get(job_id)["state"] == "PREPARING", timeout=60)
        time.sleep(1.0)
        # the lock stays held throughout: a cancel that waited for it would never return
        # (job cancel gives up after 120 s with an error, failing gl())
        out = json.loads(gl("job", "cancel", job_id, "--json").stdout)
        assert out["state"] == "CANCELLED", out
        assert get(job_id)["cause"] == "cancelled while preparing"
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
