"""A rank's BaseExceptions are the rank's; results a caller can always read (issue 17).

Real launches of CPU workers; every failure here used to be silent or misattributed: a rank's
KeyboardInterrupt raised as the caller's own, sys.exit(0) / os._exit(0) inside the function
turned into a None result, an unpicklable result an anonymous pickle error."""

from __future__ import annotations

import subprocess
import textwrap

import pytest
from conftest import PY, python_env

from gpulaunch import distributed
from gpulaunch.errors import RemoteError, ResultLoadError, SerializationError, WorkerCrashError


def _on_rank_1(what: str):
    import os
    import sys
    if os.environ["RANK"] == "1":
        if what == "interrupt":
            raise KeyboardInterrupt
        if what == "exit0":
            sys.exit(0)
        if what == "os_exit0":
            os._exit(0)
    return int(os.environ["RANK"])


def _launch(what: str) -> BaseException | list:
    try:
        return distributed(gpus=2)(_on_rank_1).distributed(what)
    except BaseException as e:  # noqa: BLE001 - a KeyboardInterrupt too: the test inspects it
        return e


def test_keyboard_interrupt_in_a_rank_is_a_run_error_naming_the_rank():
    err = _launch("interrupt")
    assert isinstance(err, RemoteError), repr(err)      # never the caller's own Ctrl-C
    assert err.rank == 1 and err.remote_type == "builtins.KeyboardInterrupt"
    assert "Rank 1" in str(err)


def test_sys_exit_0_inside_the_function_is_a_failure_that_says_so():
    err = _launch("exit0")
    assert isinstance(err, WorkerCrashError), repr(err)
    assert err.rank == 1 and "sys.exit(0)" in str(err)


def test_os_exit_0_inside_the_function_is_a_failure_not_a_none_result():
    err = _launch("os_exit0")
    assert isinstance(err, WorkerCrashError), repr(err)
    assert err.rank == 1 and "without returning a result" in str(err)


def test_a_scripts_sys_exit_0_is_still_its_success(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import sys\nprint('done', flush=True)\nsys.exit(0)\n")
    out = subprocess.run([PY, "-m", "gpulaunch.cli", "run", "--gpus", "2", str(script)],
                         capture_output=True, text=True, timeout=120, env=python_env())
    assert out.returncode == 0, out.stdout + out.stderr


class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("str() itself fails")


def test_an_exception_whose_str_raises_is_reported_with_its_type():
    def f():
        raise BadStr("x")

    with pytest.raises(BadStr) as info:
        distributed(gpus=2)(f).distributed()
    assert info.value.rank in (0, 1)


def _result_only_ranks_can_import(folder: str):
    """Write a module the caller does not have on its path, return an instance of its class."""
    import importlib
    import os
    import sys
    path = os.path.join(folder, f"rankonly{os.environ['RANK']}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "rankonly_mod.py"), "w") as f:
        f.write("class Thing:\n    pass\n")
    sys.path.insert(0, path)
    return importlib.import_module("rankonly_mod").Thing()


def test_a_result_the_caller_cannot_unpickle_names_rank_reason_and_file(tmp_path):
    with pytest.raises(ResultLoadError) as info:
        distributed(gpus=2)(_result_only_ranks_can_import).distributed(str(tmp_path))
    err = info.value
    assert isinstance(err, SerializationError)
    assert err.rank == 0 and "rank 0" in str(err) and "rankonly_mod" in str(err)
    assert err.path and err.path in str(err)
    with open(err.path, "rb") as f:                         # the raw file was kept
        assert b"rankonly_mod" in f.read()


def test_a_large_result_warns_naming_rank_and_size(monkeypatch):
    monkeypatch.setenv("GPULAUNCH_RESULT_WARN_BYTES", "100000")

    def f():
        import os
        return b"z" * (300_000 if os.environ["RANK"] == "1" else 10)

    with pytest.warns(ResourceWarning, match=r"rank 1 returned a 29\d\.\d KiB result") as rec:
        out = distributed(gpus=2)(f).distributed()
    assert len(out[1]) == 300_000
    assert not [w for w in rec if "rank 0" in str(w.message)]


def test_results_are_streamed_to_the_file_not_built_in_memory(tmp_path):
    # a value whose pickle is written in pieces: the file grows while the pickler runs
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parents[2] / 'src')!r})
        from pathlib import Path
        from gpulaunch.rank import results
        target = Path({str(tmp_path / 'r.pkl')!r})
        seen = []
        class Probe:
            def __reduce__(self):
                tmp = target.with_name('.' + target.name + '.tmp')
                seen.append(tmp.stat().st_size)
                return (bytes, (b'',))
        results.write(target, [b'a' * (1 << 20), Probe()])
        assert seen and seen[0] >= 1 << 20, seen   # 1 MiB already on disk before the end
        print('ok')
    """)
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
