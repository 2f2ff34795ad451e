"""Privacy on a shared host (issue 17): everything under the home is owner-only, an unsafe
GPULAUNCH_HOME is refused with the fix, env= values and secret-looking arguments never reach
the disk. Real launches; the checks read the real files."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
from conftest import PY, latest_run_dir, python_env

from gpulaunch import distributed
from gpulaunch.common.redact import mask_argv
from gpulaunch.errors import ConfigurationError

SECRET = "s3cr3t-Value-0451"


def _modes(root):
    for dirpath, dirs, files in os.walk(root):
        yield dirpath, stat.S_IMODE(os.stat(dirpath).st_mode)
        for f in files:
            p = os.path.join(dirpath, f)
            yield p, stat.S_IMODE(os.stat(p).st_mode)


def _grep(root, needle: str) -> list[str]:
    hits = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                if needle.encode() in fh.read():
                    hits.append(p)
    return hits


def test_home_and_every_run_file_are_owner_only(gpulaunch_home):
    def f():
        print("hello", flush=True)
        return 1

    assert distributed(gpus=2)(f).distributed() == [1, 1]
    modes = dict(_modes(gpulaunch_home))
    bad = {p: oct(m) for p, m in modes.items()
           if (m != 0o700 if os.path.isdir(p) else m & 0o077)}
    assert not bad, "\n".join(f"{p}: {m}" for p, m in bad.items())
    assert any(p.endswith("rank0.log") for p in modes) and \
        any(p.endswith("launch.json") for p in modes)


def test_a_group_writable_home_is_refused_with_the_fix(tmp_path, monkeypatch):
    home = tmp_path / "shared-home"
    home.mkdir()
    os.chmod(home, 0o777)
    monkeypatch.setenv("GPULAUNCH_HOME", str(home))
    with pytest.raises(ConfigurationError, match=f"chmod 700 {home}"):
        distributed(gpus=1)(lambda: 1).distributed()
    assert list(home.iterdir()) == []                       # nothing was created


def test_the_default_home_of_an_older_version_is_tightened(tmp_path, monkeypatch):
    monkeypatch.delenv("GPULAUNCH_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".gpulaunch").mkdir(mode=0o755)
    os.chmod(tmp_path / ".gpulaunch", 0o755)
    assert distributed(gpus=1)(lambda: 2).distributed() == [2]
    assert stat.S_IMODE(os.stat(tmp_path / ".gpulaunch").st_mode) == 0o700


def test_env_values_never_reach_the_disk(gpulaunch_home):
    def f():
        import os
        return os.environ.get("MY_API_TOKEN")

    out = distributed(gpus=2, env={"MY_API_TOKEN": SECRET})(f).distributed()
    assert out == [SECRET, SECRET]                          # the ranks got the value
    run_dir = latest_run_dir(gpulaunch_home)
    hits = [p for p in _grep(run_dir, SECRET) if not p.endswith("result.pkl")]
    assert not hits, hits                                   # no record, log or status has it
    assert "MY_API_TOKEN" in (run_dir / "launch.json").read_text()   # the name is kept


def test_secret_looking_arguments_are_masked_in_the_launch_record(gpulaunch_home, tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import sys\nprint('ARGV', sys.argv[1:], flush=True)\n")
    out = subprocess.run([PY, "-m", "gpulaunch.cli", "run", "--gpus", "1", str(script),
                          "--token", SECRET, f"--api-key={SECRET}", "--lr", "3"],
                         capture_output=True, text=True, timeout=120,
                         env=python_env({"GPULAUNCH_HOME": str(gpulaunch_home)}))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"'--token', '{SECRET}'" in out.stdout           # the rank got the real argv
    run_dir = latest_run_dir(gpulaunch_home)
    record = (run_dir / "launch.json").read_text()
    assert SECRET not in record and "***" in record and '"--lr"' in record
    hits = [p for p in _grep(run_dir, SECRET) if not p.endswith(".log")]
    assert not hits, hits


def test_mask_argv_forms():
    assert mask_argv(["train.py", "--token", "abc", "--lr", "1"]) == \
        ("train.py", "--token", "***", "--lr", "1")
    assert mask_argv(["--api-key=abc", "HF_TOKEN=xyz", "--password", "p", "--epochs=3"]) == \
        ("--api-key=***", "HF_TOKEN=***", "--password", "***", "--epochs=3")
