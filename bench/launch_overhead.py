"""Launch overhead of gpulaunch and its peers, measured side by side, interleaved.

For an "empty" distributed function (initialise the process group, one all_reduce) it measures,
per launcher and worker count:

* ``to_collective``: wall time from the call to the moment the LAST rank finished its
  all_reduce (every rank writes ``time.time()`` to a stamp file right after it);
* ``total``: wall time from the call until it returned (results back, processes gone).

Launchers (``--launchers``, default all):

    api          gpulaunch ``fn.distributed()`` from a Python process that imported gpulaunch
    api_warm     the same process's second ``fn.distributed()`` (a notebook running the cell
                 again): the first call is untimed, then the clock starts once the standby
                 agent it left (torch imported) is ready
    pool         the same process's second call with ``keep_alive=`` (the warm rank pool: the
                 ranks, their process group and rt.state stay up; only the payload travels);
                 the first call, which starts the pool, is untimed
    api_spawn    the same with ``GPULAUNCH_START_METHOD=spawn`` (ranks are fresh interpreters,
                 as before the fork start; shows what the fork start saves)
    cli          ``gpulaunch run --gpus N script.py`` (a fresh command, interpreter start included)
    torchrun     ``torchrun --nproc-per-node N script.py`` (likewise)
    elastic      ``torch.distributed.launcher.elastic_launch`` (default start method: spawn)
    elastic_fork ``elastic_launch`` with start_method="fork"
    accelerate   Accelerate's ``notebook_launcher`` (elastic_launch + fork underneath)
    ray_warm     Ray Train ``TorchTrainer.fit()`` on a Ray cluster already running (the driver
                 connects before the clock starts; the first fit of that driver is timed)
    ray_warm2    the same driver's second ``fit()`` (a notebook re-running the cell); measured
                 in ray_warm's process, right after its first fit (needs ray_warm)
    ray_cold     ``ray.init()`` (a new local cluster) + ``TorchTrainer.fit()``

Each measurement runs in a fresh Python process (``--one``) that imports what the launcher
needs (torch, gpulaunch, accelerate, ray) BEFORE the clock starts, as a notebook would have;
command-line launchers are timed as whole commands. Every repetition runs every launcher once,
in a rotated order, so the load of a shared machine hits all of them alike; the 1-minute load
average is recorded before every measurement. For gpulaunch ``.distributed()`` the run
directory's timestamps also give where the time went (agent start, rank start, ...).

    python bench/launch_overhead.py --workers 2,4 --reps 5 --out /tmp/lo
    python bench/launch_overhead.py --workers 2 --reps 1 --launchers api,torchrun   # smoke
    python bench/launch_overhead.py --device cuda --workers 1 --reps 5 \
        --launchers api,api_warm,pool --out $OUT      # GPU: NCCL, gpulaunch launchers only

Results: ``<out>/launch_overhead.json`` and ``<out>/launch_overhead.md``. Nothing here asserts
on time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _proc import exit_on_sigterm, run_group  # bench/_proc.py

ROOT = Path(__file__).resolve().parents[1]
ALL = ["api", "api_warm", "pool", "api_spawn", "cli", "torchrun", "elastic", "elastic_fork", "accelerate", "ray_warm", "ray_warm2",
       "ray_cold"]
LABELS = {
    "api": "gpulaunch `.distributed()`",
    "api_warm": "gpulaunch `.distributed()`, 2nd call (standby agent)",
    "pool": "gpulaunch `.distributed()`, 2nd call, `keep_alive=` (warm pool)",
    "api_spawn": "gpulaunch `.distributed()`, `GPULAUNCH_START_METHOD=spawn`",
    "cli": "`gpulaunch run` (CLI)",
    "torchrun": "`torchrun`",
    "elastic": "`elastic_launch` (spawn)",
    "elastic_fork": "`elastic_launch` (fork)",
    "accelerate": "Accelerate `notebook_launcher` (fork)",
    "ray_warm": "Ray Train `TorchTrainer.fit()`, cluster running, 1st fit",
    "ray_warm2": "Ray Train `TorchTrainer.fit()`, same driver, 2nd fit",
    "ray_cold": "Ray Train, `ray.init()` + `fit()` (cold)",
}

# The script the command-line launchers run (argv[1]: the stamp directory).
SCRIPT = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w") as f:
        f.write(repr(time.time()))
    assert t.item() == dist.get_world_size()
    dist.destroy_process_group()
""")


# ----------------------------------------------------------------------------- rank functions
def _stamp(stamp_dir: str, rank: int) -> None:
    with open(os.path.join(stamp_dir, f"rank{rank}"), "w") as f:
        f.write(repr(time.time()))


def empty_fn(stamp_dir: str) -> float:
    """What every function launcher runs: init the group (env://), one all_reduce, stamp."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    _stamp(stamp_dir, dist.get_rank())
    out = t.item()
    dist.destroy_process_group()
    return out


def gpu_fn(stamp_dir: str) -> float:
    """``--device cuda``: the same on GPUs, as a user writes it (rt.init(): NCCL, device bound)."""
    import torch
    import torch.distributed as dist

    from gpulaunch import runtime as rt
    dev = rt.init()
    t = torch.ones(1, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    _stamp(stamp_dir, dist.get_rank())
    out = t.item()
    dist.destroy_process_group()
    return out


def ray_fn(config: dict) -> None:
    """Ray Train initialises the process group itself before calling us."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    _stamp(config["stamp_dir"], dist.get_rank())


# ----------------------------------------------------------------------------- one measurement
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(stamp_dir: str, n: int, t0: float) -> float | None:
    stamps = []
    for r in range(n):
        p = os.path.join(stamp_dir, f"rank{r}")
        if not os.path.exists(p):
            return None
        stamps.append(float(Path(p).read_text()))
    return max(stamps) - t0


def _gpulaunch_phases(t0: float, t_end: float) -> dict:
    """Where a .distributed() call spent its time, from the run directory's own timestamps."""
    from gpulaunch.common import rundir

    runs = sorted(rundir.runs_root().iterdir(), key=lambda p: p.stat().st_mtime)
    run = rundir.RunDir(runs[-1])
    status = rundir.read_json(run.status_json, {})
    infos = [rundir.read_json(p, {}) for p in run.attempt_dir(0).glob("rank*.info.json")]
    results = list(run.attempt_dir(0).glob("rank*.result.pkl"))
    ph = {"agent_started": status.get("started", float("nan")) - t0,
          "first_rank_started": min(i["started"] for i in infos) - t0,
          "last_rank_started": max(i["started"] for i in infos) - t0,
          "last_result_written": max(p.stat().st_mtime for p in results) - t0,
          "agent_ended": status.get("ended", float("nan")) - t0,
          "returned": t_end - t0}
    return {**{k: round(v, 4) for k, v in ph.items()}, "warm_start": bool(status.get("warm_start"))}


def measure_one(launcher: str, n: int, stamp_dir: str, script: str) -> dict:
    """Runs in its own process. Imports first (untimed), then times the launch."""
    extra: dict = {}
    cuda = os.environ.get("BENCH_DEVICE") == "cuda"
    if cuda and launcher not in ("api", "api_warm", "api_spawn", "pool"):
        raise SystemExit(f"--device cuda measures gpulaunch's launchers only, not {launcher}")
    if launcher in ("api", "api_warm", "api_spawn", "pool"):
        if launcher == "api_spawn":
            os.environ["GPULAUNCH_START_METHOD"] = "spawn"
        from gpulaunch import distributed
        fn = distributed(gpus=n, stream_logs="none", keep_alive=launcher == "pool",
                         tracking=False)(gpu_fn if cuda else empty_fn)
        if launcher == "pool":
            first = tempfile.mkdtemp(prefix="stamps-")
            fn.distributed(first)             # untimed: the call that starts the pool
            shutil.rmtree(first, ignore_errors=True)
            time.sleep(1.0)                   # a person re-running the cell; ranks tidy up
        if launcher == "api_warm":
            from gpulaunch.backends.local.standby import STANDBY
            first = tempfile.mkdtemp(prefix="stamps-")
            fn.distributed(first)             # untimed: the call that leaves a standby agent
            shutil.rmtree(first, ignore_errors=True)
            if not STANDBY.wait_ready(120):
                raise RuntimeError("no standby agent got ready after the first call")
        t0 = time.time()
        out = fn.distributed(stamp_dir)
        t1 = time.time()
        assert out == [float(n)] * n, out
        extra["phases"] = _gpulaunch_phases(t0, t1)
        if launcher == "pool":
            import gpulaunch
            gpulaunch.shutdown()
    elif launcher in ("cli", "torchrun"):
        cmd = ([sys.executable, "-m", "gpulaunch.cli", "run", "--gpus", str(n), "--logs", "none",
                script, stamp_dir] if launcher == "cli" else
               [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
                script, stamp_dir])
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        t1 = time.time()
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    elif launcher in ("elastic", "elastic_fork"):
        import torch  # noqa: F401
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch
        cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id="bench",
                           rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}",
                           start_method="fork" if launcher == "elastic_fork" else "spawn")
        t0 = time.time()
        out = elastic_launch(cfg, empty_fn)(stamp_dir)
        t1 = time.time()
        assert sorted(out.values()) == [float(n)] * n, out
    elif launcher == "accelerate":
        import torch  # noqa: F401
        from accelerate import notebook_launcher
        t0 = time.time()
        notebook_launcher(empty_fn, (stamp_dir,), num_processes=n, use_port=str(_free_port()))
        t1 = time.time()
    elif launcher.startswith("ray"):
        import ray
        import torch  # noqa: F401
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        storage = tempfile.mkdtemp(prefix="raytrain-")

        def fit(tag: str, sd: str):
            TorchTrainer(ray_fn, train_loop_config={"stamp_dir": sd},
                         scaling_config=ScalingConfig(num_workers=n, use_gpu=False),
                         run_config=RunConfig(storage_path=storage, name=tag)).fit()

        if launcher == "ray_cold":
            t0 = time.time()
            ray.init(address="local", num_cpus=max(n, 2) + 2, include_dashboard=False,
                     log_to_driver=False)
            extra["ray_init_s"] = time.time() - t0
            fit("cold", stamp_dir)
            t1 = time.time()
        else:
            ray.init(address=os.environ["BENCH_RAY_ADDRESS"], log_to_driver=False)
            t0 = time.time()
            fit("first", stamp_dir)
            t1 = time.time()
            # the same driver's second fit (a notebook re-running the cell): ray_warm2
            second = tempfile.mkdtemp(prefix="stamps-")
            t2 = time.time()
            fit("second", second)
            t3 = time.time()
            extra["second"] = {"to_collective": _collect(second, n, t2), "total": t3 - t2}
            shutil.rmtree(second, ignore_errors=True)
        ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)
    else:
        raise SystemExit(f"unknown launcher {launcher!r}; known: {', '.join(ALL)}")
    return {"to_collective": _collect(stamp_dir, n, t0), "total": t1 - t0, **extra}


# ----------------------------------------------------------------------------- driver
class RayCluster:
    """A Ray head started once for ray_warm, in its own session, and stopped by signalling that
    session's process group. (Never ``ray stop``: it kills EVERY Ray process of the user on the
    machine, other people's clusters included.) Every port is picked free, so another Ray
    cluster on the same machine does not collide with this one; RAY_TMPDIR is short (the
    socket path limit)."""

    def __init__(self, num_cpus: int):
        self.tmp = tempfile.mkdtemp(prefix="rb", dir="/tmp")
        env = {**os.environ, "RAY_TMPDIR": self.tmp, "RAY_AUTH_MODE": "disabled",
               "RAY_USAGE_STATS_ENABLED": "0"}
        port = _free_port()
        ports = {flag: _free_port() for flag in (
            "--ray-client-server-port", "--dashboard-port", "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port", "--metrics-export-port", "--node-manager-port",
            "--object-manager-port", "--runtime-env-agent-port")}
        cmd = [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start", "--head",
               "--block", f"--num-cpus={num_cpus}", f"--port={port}", "--include-dashboard=false",
               "--disable-usage-stats"] + [f"{k}={v}" for k, v in ports.items()]
        self.log = open(os.path.join(self.tmp, "ray_start.log"), "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.address = f"127.0.0.1:{port}"
        # wait until the head answers (bounded)
        deadline = time.monotonic() + 120
        while True:
            probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={self.address!r}); "
                                    "ray.shutdown()"], env=env, capture_output=True, text=True)
            if probe.returncode == 0:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("ray start --head failed:\n"
                                   + Path(self.log.name).read_text()[-3000:] + probe.stderr[-2000:])
            time.sleep(2)

    def stop(self) -> None:
        import signal
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        try:  # raylet, gcs and workers live in the same group: make sure none is left
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _one_env(base: dict) -> dict:
    env = {**base, "PYTHONUNBUFFERED": "1", "GPULAUNCH_QUIET": "1", "HF_HUB_OFFLINE": "1",
           "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    paths = [str(ROOT / "src")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_measurement(launcher: str, n: int, work: Path, env: dict, timeout: float) -> dict:
    stamp_dir = tempfile.mkdtemp(prefix="stamps-", dir=work)
    if launcher == "ray_cold":
        env = {**env, "RAY_TMPDIR": tempfile.mkdtemp(prefix="rc", dir="/tmp")}
    load = os.getloadavg()[0]
    cmd = [sys.executable, __file__, "--one", launcher, "--workers", str(n),
           "--stamp-dir", stamp_dir, "--script", str(work / "allreduce.py")]
    try:
        proc = run_group(cmd, env=env, timeout=timeout,
                              cwd=work)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode == 0 and lines:
            r = json.loads(lines[-1][len("RESULT "):])
        else:
            r = {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}
    except subprocess.TimeoutExpired:
        r = {"error": f"timed out after {timeout} s"}
    finally:
        if launcher == "ray_cold":
            shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
        shutil.rmtree(stamp_dir, ignore_errors=True)
    r["load1"] = load
    return r


def _stats(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def report(results: dict, meta: dict, out: Path) -> str:
    where = "NCCL on GPUs" if meta.get("device") == "cuda" else "gloo on CPU"
    lines = [f"Launch overhead, empty function (init_process_group + one all_reduce), {where}. "
             f"{meta['host']}: {meta['cpus']} cores, Python {meta['python']}, torch {meta['torch']}; "
             f"{meta['date']}; {meta['reps']} interleaved repetitions; 1-min load average during "
             f"the runs: median {meta['load_median']:.2f} (min {meta['load_min']:.2f}, max "
             f"{meta['load_max']:.2f}).", "",
             "| workers | launcher | to all ranks' collective, median (min–max) s | "
             "to results returned, median (min–max) s |", "|---|---|---|---|"]
    for n, per in results.items():
        for name, rs in per.items():
            ok = [r for r in rs if "error" not in r]
            c, t = _stats([r["to_collective"] for r in ok]), _stats([r["total"] for r in ok])
            cell = (lambda s: f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})" if s else "—")
            errs = len(rs) - len(ok)
            lines.append(f"| {n} | {LABELS[name]} | {cell(c)} | {cell(t)}"
                         f"{f' ({errs} failed)' if errs else ''} |")
    keys = ["agent_started", "first_rank_started", "last_rank_started", "last_result_written",
            "agent_ended", "returned"]
    rows = []
    for n, per in results.items():
        for name in ("api", "api_warm", "pool", "api_spawn"):
            ps = [r["phases"] for r in per.get(name, []) if "phases" in r]
            if ps:
                rows.append(f"| {n} | {name} | " + " | ".join(
                    f"{statistics.median(p[k] for p in ps):.2f}" for k in keys) + " |")
    if rows:
        lines += ["", "Where gpulaunch `.distributed()` spends it (seconds after the call, median, "
                  "from the run directory's timestamps):", "",
                  "| workers | launcher | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
        lines += rows
    for n, per in results.items():
        for name, rs in per.items():
            for r in rs:
                if "error" in r:
                    lines += ["", f"{name} ({n} workers) error:", "```", r["error"][-1500:], "```"]
                    break
    text = "\n".join(lines) + "\n"
    (out / "launch_overhead.md").write_text(text)
    (out / "launch_overhead.json").write_text(json.dumps({"meta": meta, "results": results},
                                                         indent=1))
    return text


def _meta(a, counts, launchers, loads) -> dict:
    import torch
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "reps": a.reps, "workers": counts, "launchers": launchers,
            "load_median": statistics.median(loads), "load_min": min(loads),
            "load_max": max(loads), "command": " ".join(["python"] + sys.argv),
            "device": a.device}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="2,4", help="comma-separated worker counts")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--launchers", default=",".join(ALL))
    p.add_argument("--out", default=None, help="folder for launch_overhead.{json,md}")
    p.add_argument("--timeout", type=float, default=240, help="seconds per measurement")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: NCCL on this host's GPUs (gpulaunch launchers only)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--stamp-dir", help=argparse.SUPPRESS)
    p.add_argument("--script", help=argparse.SUPPRESS)
    a = p.parse_args()

    if a.one:
        print("RESULT " + json.dumps(measure_one(a.one, int(a.workers), a.stamp_dir, a.script)),
              flush=True)
        return

    exit_on_sigterm()
    launchers = a.launchers.split(",")
    unknown = set(launchers) - set(ALL)
    if unknown:
        p.error(f"unknown launchers {sorted(unknown)}; known: {', '.join(ALL)}")
    counts = [int(x) for x in a.workers.split(",")]
    out = Path(a.out or tempfile.mkdtemp(prefix="launch_overhead-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lo-"))
    (work / "allreduce.py").write_text(SCRIPT)
    env = _one_env(os.environ)
    env["GPULAUNCH_HOME"] = str(work / "gpulaunch_home")
    env["TMPDIR"] = str(work)  # torchrun leaves /tmp/torchelastic_* behind; keep it in here
    env.setdefault("GPULAUNCH_MAX_CPU_WORKERS", str(max(counts)))
    if a.device == "cuda":
        env["BENCH_DEVICE"] = "cuda"
    else:
        env["GPULAUNCH_FORCE_CPU"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    cluster = None
    if "ray_warm2" in launchers and "ray_warm" not in launchers:
        p.error("ray_warm2 is measured by ray_warm's process: ask for ray_warm too")
    if "ray_warm" in launchers:
        cluster = RayCluster(num_cpus=max(counts) + 2)
        env["BENCH_RAY_ADDRESS"] = cluster.address
    results: dict = {n: {name: [] for name in launchers} for n in counts}
    loads = []
    try:
        for n in counts:
            for rep in range(a.reps):
                order = launchers[rep % len(launchers):] + launchers[:rep % len(launchers)]
                for name in order:
                    if name == "ray_warm2":
                        continue  # measured inside ray_warm's process (its driver's 2nd fit)
                    r = run_measurement(name, n, work, env, a.timeout)
                    loads.append(r["load1"])
                    results[n][name].append(r)
                    if "second" in r and "ray_warm2" in results[n]:
                        results[n]["ray_warm2"].append({**r.pop("second"), "load1": r["load1"]})
                    print(f"{n} workers rep {rep} {name}: "
                          + json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                        for k, v in r.items()})[:600], flush=True)
                    report(results, _meta(a, counts, launchers, loads), out)  # partial, survives a kill
    finally:
        if cluster:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(report(results, _meta(a, counts, launchers, loads), out))
    print(f"written: {out}/launch_overhead.md, {out}/launch_overhead.json")


if __name__ == "__main__":
    main()
