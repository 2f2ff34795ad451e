"""The GPU suite's per-test rows for its summary (scripts/gpu_suite.sh), from what pytest left:
its junit XML, else the lines tests/gpu/conftest.py wrote as each test finished, and the list of
tests it collected. Pure: files in, rows out; tested on CPU (tests/test_gpu_suite_rows.py).

A run cut short by the suite's time cap (SIGINT) still writes junit, with one nameless
``<testcase>`` for the test that was running: that one is "interrupted", not passed. Tests that
were collected and never reported are "not run", so a short run reads as short."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

STATUS = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}


def short(nodeid: str) -> str:
    """``tests/gpu/test_x.py::test_y[a]`` -> ``test_x::test_y[a]`` (junit's form)."""
    path, _, name = nodeid.partition("::")
    return f"{Path(path).stem}::{name}"


def rows(junit: Path, results: Path, collected: Path | None = None) -> tuple[list, str | None]:
    """(status, seconds, test, message) per test, and a note on where they came from."""
    out, note = [], None
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            if case.get("name") is None:        # the test the cap interrupted
                out.append(("interrupted", float(case.get("time") or 0),
                            "(the test running when the time cap hit)", ""))
                continue
            status, msg = "passed", ""
            for tag, label in STATUS.items():
                el = case.find(tag)
                if el is not None:
                    status = label
                    msg = (el.get("message") or "").splitlines()[0][:160] if el.get("message") else ""
                    break
            out.append((status, float(case.get("time") or 0),
                        f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}", msg))
    elif results.exists():
        for line in results.read_text().splitlines():
            r = json.loads(line)
            out.append((r["outcome"], r["seconds"], short(r["test"]),
                        (r.get("reason") or r.get("message") or "")[:160]))
        note = "(no junit XML: the run was cut short; results below are what finished)"
    if collected is not None and collected.exists():
        seen = {name for _, _, name, _ in out}
        out += [("not run", 0.0, short(n), "") for n in collected.read_text().split()
                if short(n) not in seen]
    return out, note
