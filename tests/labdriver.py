"""A real JupyterLab server and a headless Chromium driven over the Chrome DevTools Protocol,
for tests/notebook/test_panel_browser.py. Nothing downloaded at test time: JupyterLab from the test
environment (PyPI ``jupyterlab``), the browser from the system (Debian's ``chromium``), the
protocol over ``websocket-client`` (a dependency of jupyter_server).

Both run in sessions of their own; ``stop()`` kills each one's whole process tree (the lab's
kernels, chromium's helpers) by the pids recorded, and reports what would not die.
"""

from __future__ import annotations

import base64
import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def missing() -> str:
    """Why the browser test cannot run here ('' when it can)."""
    why = []
    if importlib.util.find_spec("jupyterlab") is None:
        why.append(f"jupyterlab is not installed in {sys.prefix} (pip install jupyterlab: it "
                   "is in the test extra, scripts/venv.sh)")
    if importlib.util.find_spec("websocket") is None:
        why.append("websocket-client is not installed (it comes with jupyter_server)")
    if not find_browser():
        why.append("no chromium on PATH (apt-get install chromium: scripts/ci_browser.sh)")
    return "; ".join(why)


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def wait_until(what: str, probe, timeout: float, interval: float = 0.25):
    """Poll ``probe()`` until it returns something truthy (returned); fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


class Proc:
    """A process started in a session of its own, with its output in a file."""

    def __init__(self, argv, log: Path, env=None, cwd=None):
        self.log = log
        self._out = open(log, "wb")
        self.popen = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                      cwd=cwd, start_new_session=True)
        self.seen: set[int] = {self.popen.pid}

    def note_children(self) -> None:
        """Remember every descendant now (they may leave the tree once their parent dies)."""
        try:
            self.seen.update(c.pid for c in
                             psutil.Process(self.popen.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def stop(self, grace: float = 10.0) -> list[int]:
        """Kill the process, its session and every descendant seen; return survivors' pids."""
        self.note_children()
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.seen:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        self._out.close()
        return _alive(self.seen, wait=grace)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _alive(pids, wait: float) -> list[int]:
    deadline = time.monotonic() + wait
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def start_lab(root: Path, work: Path, token: str, env: dict) -> tuple[Proc, str]:
    """``jupyter lab`` on 127.0.0.1 (a free port it picks) serving ``root``; returns it and its
    base URL once it answers. Its config, settings, workspaces and runtime files stay in
    ``work`` (nothing from the user's ~/.jupyter)."""
    env = dict(env)
    for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                     ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                     ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"), ("IPYTHONDIR", "ipython")):
        (work / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(work / sub)
    argv = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
            "--ServerApp.port=0", f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--ServerApp.terminals_enabled=False", "--LabApp.extension_manager=readonly"]
    if os.geteuid() == 0:
        argv.append("--allow-root")      # CI containers run as root
    lab = Proc(argv, work / "lab.log", env=env, cwd=root)

    def ready():
        if lab.popen.poll() is not None:
            raise AssertionError(f"jupyter lab exited ({lab.popen.returncode}):\n{lab.tail()}")
        for f in glob.glob(str(work / "runtime" / "jpserver-*.json")):
            try:
                info = json.loads(Path(f).read_text())
                url = f"http://127.0.0.1:{info['port']}"
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5).read()
                return url
            except (OSError, ValueError, KeyError):
                pass
        return None
    try:
        return lab, wait_until("jupyter lab to answer", ready, timeout=120, interval=0.5)
    except BaseException:
        lab.stop()
        raise


class Browser:
    """Headless Chromium with one page, driven over CDP (``--remote-debugging-port``)."""

    def __init__(self, work: Path, url: str, width: int = 1280, height: int = 900):
        import websocket
        profile = work / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        argv = [find_browser(), "--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--mute-audio",
                "--hide-scrollbars", f"--window-size={width},{height}",
                f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0", url]
        self.proc = Proc(argv, work / "chromium.log")
        try:
            port_file = profile / "DevToolsActivePort"
            port = wait_until("chromium's DevToolsActivePort",
                              lambda: self._alive() and port_file.exists()
                              and port_file.read_text().split("\n")[0].strip(), timeout=60)
            pages = wait_until("chromium's page target", lambda: [
                t for t in json.loads(urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/json/list", timeout=5).read())
                if t.get("type") == "page"], timeout=60)
            self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=60,
                                                  suppress_origin=True)
        except BaseException:
            self.proc.stop()
            raise
        self._id = 0

    def _alive(self) -> bool:
        if self.proc.popen.poll() is not None:
            raise AssertionError(f"chromium exited ({self.proc.popen.returncode}):\n"
                                 f"{self.proc.tail()}")
        return True

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"CDP {method}: {msg['error']}")
                return msg["result"]

    def js(self, expression: str):
        """Evaluate in the page (promises awaited); the value, JSON-transferred."""
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                      awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page JS error: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self, selector: str, path: Path, margin: int = 4) -> Path:
        """A PNG of the element ``selector``: its bounding box plus ``margin`` above and on the
        sides (not below, where the cell's next output starts)."""
        box = self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
                      " e.scrollIntoView({block: 'start'}); const r = e.getBoundingClientRect();"
                      " return [r.x, r.y, r.width, r.height]; })()")
        x, y, w, h = box
        clip = {"x": max(0, x - margin), "y": max(0, y - margin), "width": w + 2 * margin,
                "height": h + margin, "scale": 1}
        data = self.call("Page.captureScreenshot", format="png", clip=clip)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def stop(self) -> list[int]:
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001 - closing a dead socket
            pass
        return self.proc.stop()
