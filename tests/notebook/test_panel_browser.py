"""The live panel in a real JupyterLab, seen by a real browser: ``jupyter lab`` (PyPI) on
loopback with a token, a notebook training a 2-rank CPU DDP model (gloo) with a tqdm bar and
``rt.report`` metrics, headless Chromium (the system's) driven over the DevTools protocol runs
all cells with JupyterLab's own "run all" command; the test reads the rendered panel from the
page's DOM while the run is going (both rows ``running``, the bar at 20/40, metrics, the loss
plot, Stop/Stacks/Logs) and after it ended (``finished``, the outcome, only Logs left), and
screenshots the panel both times.

The run waits at step 20 of 40 until the test has looked (a gate file), so the live view is
caught without a timing window. Screenshots go to ``$GPULAUNCH_SCREENSHOTS`` when set (how
docs/img/panel-*.png were made), else to the test's tmp dir. Lab, kernel, ranks and browser are
killed at the end, pass or fail, and the test checks that none survived.

Skips, saying why, without jupyterlab or chromium (scripts/ci_browser.sh installs chromium in
CI; ``GPULAUNCH_REQUIRE_BROWSER=1``, set by .ci/run once it is there, turns a skip into a
failure).
"""

from __future__ import annotations

import json
import os
import secrets
import urllib.request
from pathlib import Path

import nbformat
import psutil
import pytest
from conftest import assert_no_survivors, python_env, run_pids
from labdriver import Browser, missing, start_lab, wait_until

pytest.importorskip("ipywidgets")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(540)]

TRAIN = '''\
import os, sys, time
import torch
from tqdm import tqdm
from gpulaunch import distributed, runtime as rt

GATE = {gate!r}   # the test opens it once it has seen the live panel

@distributed(gpus=2, stream_logs="none")
def train(steps=40):
    rt.init()                                   # gloo on CPU ranks
    torch.manual_seed(rt.get_global_rank())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = torch.linspace(-1, 1, 8)
    for step in tqdm(range(steps), desc="train", file=sys.stderr, mininterval=0):
        if step == steps // 2:
            deadline = time.time() + 300
            while not os.path.exists(GATE) and time.time() < deadline:
                time.sleep(0.1)
        x = torch.randn(64, 8)
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x @ w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rt.report(step=step, loss=loss, lr=0.05)
        time.sleep(0.05)
    return round(loss.item(), 4)

print("RESULT", train.distributed())
'''

# what the page shows of the panel (and of the cell's printed output)
PROBE = """(() => {
  const p = document.querySelector('.gpulaunch-panel');
  if (!p) return null;
  const rows = [...p.querySelectorAll('table.gpulaunch-ranks tr')].slice(1)
      .map(tr => [...tr.cells].map(td => td.innerText.trim()));
  const bars = [...p.querySelectorAll('table.gpulaunch-ranks progress')]
      .map(e => [e.value, e.max]);
  const buttons = [...p.querySelectorAll('button')].filter(b => b.offsetParent !== null)
      .map(b => b.innerText.trim());
  const printed = [...document.querySelectorAll('.jp-OutputArea-output')]
      .map(o => o.innerText).join('\\n');
  return {text: p.innerText, rows, bars, buttons, printed,
          plots: p.querySelectorAll('svg polyline').length};
})()"""

KERNEL_STATUS = """(() => {
  const app = window.jupyterapp;
  const w = app && app.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session
      && w.sessionContext.session.kernel;
  return k ? k.status : null;
})()"""


@pytest.fixture
def lab_env():
    why = missing()
    if why:
        if os.environ.get("GPULAUNCH_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{why}\n(GPULAUNCH_REQUIRE_BROWSER=1: the browser test must run)")
        pytest.skip(why)
    return python_env()   # the kernel (and its ranks) import this checkout


def _notebook(path: Path, gate: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(TRAIN.format(gate=str(gate)))]
    nbformat.write(nb, str(path))


def _rows_are(view, state) -> bool:
    return bool(view) and len(view["rows"]) == 2 and all(r[1] == state for r in view["rows"])


def test_panel_renders_live_and_finished_in_jupyterlab(tmp_path, lab_env, gpulaunch_home):
    shots = Path(os.environ.get("GPULAUNCH_SCREENSHOTS") or tmp_path / "screenshots")
    root, work = tmp_path / "nb", tmp_path / "lab"
    root.mkdir()
    work.mkdir()
    gate = tmp_path / "gate"
    _notebook(root / "panel.ipynb", gate)
    token = secrets.token_hex(16)
    lab = browser = None
    runs = []
    try:
        lab, url = start_lab(root, work, token, lab_env)
        browser = Browser(work, f"{url}/lab/tree/panel.ipynb?token={token}")
        # the notebook opened and its kernel started
        wait_until("the notebook's kernel to be idle in the page",
                   lambda: browser.js(KERNEL_STATUS) == "idle", timeout=150)
        # JupyterLab's own "Run All" (what Run > Run All Cells does); not awaited: the cell
        # runs until the gate opens
        browser.js("void window.jupyterapp.commands.execute('notebook:run-all-cells'); true")

        def live():
            lab.note_children()      # the kernel and the ranks, to kill them whatever happens
            runs[:] = list((gpulaunch_home / "runs").glob("*")) if (
                gpulaunch_home / "runs").exists() else []
            v = browser.js(PROBE)
            return v if _rows_are(v, "running") and v["bars"] == [[20, 40], [20, 40]] \
                and "loss=" in v["text"] and v["plots"] == 1 else None
        view = wait_until("the live panel: 2 running rows at 20/40 with metrics and a plot",
                          live, timeout=180, interval=0.5)
        for _rank, state, host, device, _gpu, progress, metrics, last in view["rows"]:
            assert host and device == "cpu"
            assert progress.startswith("20/40")
            assert "lr=0.05" in metrics and "loss=" in metrics
            assert last.startswith("train:") and "20/40" in last     # the tqdm bar's line
        assert "2 ranks" in view["text"] and "loss (rank 0)" in view["text"]
        assert {"Stop", "Stacks", "Logs"} <= set(view["buttons"])
        assert "SUCCEEDED" not in view["text"]
        browser.screenshot(".gpulaunch-panel", shots / "panel-live.png")

        gate.touch()
        view = wait_until(
            "the finished panel and the cell's printed result",
            lambda: (v := browser.js(PROBE)) and _rows_are(v, "finished")
            and "SUCCEEDED: all 2 ranks returned." in v["text"] and "RESULT [" in v["printed"]
            and v, timeout=150, interval=0.5)
        assert view["bars"] == [[40, 40], [40, 40]]
        assert "Stop" not in view["buttons"] and "Logs" in view["buttons"]
        assert view["plots"] == 1
        browser.screenshot(".gpulaunch-panel", shots / "panel-finished.png")
        for name in ("panel-live.png", "panel-finished.png"):
            png = (shots / name).read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
        assert len(runs) == 1
        # the lab's kernel shut down as a user would (the sessions API), leaving no rank
        _shutdown_sessions(url, token)
        assert_no_survivors(runs[0], wait=30)
    finally:
        left = []
        if browser is not None:
            left += browser.stop()
        if lab is not None:
            left += lab.stop()
        for run in runs:                       # a rank left over from a failure: end it too
            for pid in run_pids(run):
                try:
                    proc = psutil.Process(pid)
                    if proc.status() != psutil.STATUS_ZOMBIE:
                        proc.kill()
                        left.append(pid)
                except psutil.NoSuchProcess:
                    pass
    assert not left, f"processes survived the test: {left}"


def _shutdown_sessions(url: str, token: str) -> None:
    def call(method, path):
        req = urllib.request.Request(f"{url}{path}", method=method,
                                     headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None
    for s in call("GET", "/api/sessions"):
        call("DELETE", f"/api/sessions/{s['id']}")
