"""scripts/gpu_suite_rows.py: the GPU suite summary's rows, including a run that the suite's
time cap cut short (the shape pytest really left on the lent H100 on 2026-12-07: junit with a
nameless testcase for the interrupted test, which an earlier summary counted as passed)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_suite_rows import rows, short  # noqa: E402

pytestmark = pytest.mark.unit

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">
<testsuite name="pytest" errors="0" failures="1" skipped="1" tests="4" time="339.6">
<testcase classname="tests.gpu.test_gpu_launch" name="test_every_gpu_gets_a_rank" time="31.9" />
<testcase classname="tests.gpu.test_gpu_failures" name="test_oom[raise]" time="11.5">
  <failure message="AssertionError: no cause&#10;second line">trace</failure></testcase>
<testcase classname="tests.gpu.test_gpu_mesh" name="test_cp" time="0.0">
  <skipped type="pytest.skip" message="needs 2 GPUs; this host has 1">skip</skipped></testcase>
<testcase time="0.052" />
</testsuite></testsuites>"""

COLLECTED = ["tests/gpu/test_gpu_launch.py::test_every_gpu_gets_a_rank",
             "tests/gpu/test_gpu_failures.py::test_oom[raise]",
             "tests/gpu/test_gpu_mesh.py::test_cp",
             "tests/gpu/test_gpu_mesh.py::test_selective_ac",
             "tests/gpu/test_gpu_pool.py::test_second_call"]


def test_a_run_cut_by_the_cap_counts_nothing_as_passed_that_did_not_pass(tmp_path):
    (tmp_path / "j.xml").write_text(JUNIT)
    (tmp_path / "c.txt").write_text("\n".join(COLLECTED) + "\n")
    got, note = rows(tmp_path / "j.xml", tmp_path / "none.jsonl", tmp_path / "c.txt")
    assert note is None
    by = {name: (status, msg) for status, _, name, msg in got}
    assert by["test_gpu_launch::test_every_gpu_gets_a_rank"] == ("passed", "")
    assert by["test_gpu_failures::test_oom[raise]"] == ("FAILED", "AssertionError: no cause")
    assert by["test_gpu_mesh::test_cp"][0] == "skipped"
    assert by["(the test running when the time cap hit)"][0] == "interrupted"
    # the interrupted one and the one after it never reported: both read "not run"
    assert by["test_gpu_mesh::test_selective_ac"][0] == "not run"
    assert by["test_gpu_pool::test_second_call"][0] == "not run"
    assert [s for s, *_ in got].count("passed") == 1 and len(got) == 6


def test_without_junit_the_per_test_lines_are_used_in_the_same_names(tmp_path):
    lines = [{"test": COLLECTED[0], "when": "call", "outcome": "passed", "seconds": 31.9},
             {"test": COLLECTED[2], "when": "setup", "outcome": "skipped", "seconds": 0.0,
              "reason": "needs 2 GPUs"}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "c.txt").write_text("\n".join(COLLECTED) + "\n")
    got, note = rows(tmp_path / "none.xml", tmp_path / "r.jsonl", tmp_path / "c.txt")
    assert "cut short" in note
    assert [(s, n) for s, _, n, _ in got] == [
        ("passed", "test_gpu_launch::test_every_gpu_gets_a_rank"),
        ("skipped", "test_gpu_mesh::test_cp"),
        ("not run", "test_gpu_failures::test_oom[raise]"),
        ("not run", "test_gpu_mesh::test_selective_ac"),
        ("not run", "test_gpu_pool::test_second_call")]
    assert short("tests/gpu/test_a.py::test_b[x::y]") == "test_a::test_b[x::y]"
