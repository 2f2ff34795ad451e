"""``gpulaunch`` command line: run, runs, logs, doctor, plan, preempt. Thin: it calls the same code as the
Python API.

    gpulaunch run --gpus 2 train.py --lr 3e-4      # like torchrun --nproc-per-node 2 train.py
    gpulaunch run -m mypkg.train
    gpulaunch run --gpus 2 -- python -c "print(1)"
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import shutil
import signal
import sys
import time

from . import cli_nodes, cli_torchrun, errors, options
from .caller.logstream import LogStreamer, tail_text
from .common import rundir
from .common.records import Entry, NodeState, state_is_terminal
from .common.rundir import RunDir, read_json
from .hardware import host as hardware


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="run a script, module or command on every GPU (or CPU workers)",
                       description="Start N ranks with torchrun's environment (RANK, LOCAL_RANK, "
                                   "WORLD_SIZE, MASTER_ADDR, ...) and stream their logs. Every "
                                   "setting has the same default as in the Python API.")
    options.add_cli_arguments(p)           # --gpus, --timeout, --hang-timeout, ... (LaunchOptions)
    cli_nodes.add_arguments(p)
    cli_torchrun.add_arguments(p)          # torchrun's other flags, both spellings
    p.add_argument("--standalone", action="store_true", help="one node, its own rendezvous "
                   "(torchrun's flag; what gpulaunch does without --nnodes)")
    p.add_argument("--no-tracking", action="store_true",
                   help="no MLflow run for this launch (also: GPULAUNCH_TRACKING=0)")
    p.add_argument("--experiment", default=None, help="MLflow experiment name (default: gpulaunch)")
    p.add_argument("--run-name", default=None, help="MLflow run name (default: the script name)")
    p.add_argument("-m", "--module", action="store_true", help="run a module, as python -m")
    p.add_argument("--no-python", "--no_python", action="store_true", help="run the program directly (torchrun's "
                   "flag); same as putting it after --")
    p.add_argument("target", nargs=argparse.REMAINDER,
                   help="script.py [args] | -m module [args] | -- command [args]")


def _entry_from(args) -> Entry:
    target = list(args.target)
    if target and target[0] == "--":
        target = target[1:]
        if not target:
            raise errors.ConfigurationError("nothing to run after --")
        return Entry("exec", tuple(target))
    if not target:
        raise errors.ConfigurationError("gpulaunch run needs a script, -m module, or -- command")
    if args.module:
        return Entry("module", tuple(target))
    if args.no_python:
        return Entry("exec", tuple(target))
    if target[0] == "-m" and len(target) > 1:
        return Entry("module", tuple(target[1:]))
    if not os.path.exists(target[0]):
        raise errors.ConfigurationError(f"script {target[0]!r} not found (for a module use -m, "
                                        "for another program put it after --)")
    return Entry("script", tuple(target))


def cmd_run(args) -> int:
    from .caller.handle import RunHandle
    from .caller.pipeline import launch
    from .tracking import Tracking
    tracking = Tracking(enabled=False) if args.no_tracking else \
        Tracking(experiment=args.experiment, run_name=args.run_name)
    opts = options.from_cli(args, tracking=tracking)
    opts = cli_torchrun.apply(args, opts)         # torchrun's flags, or why not
    placement = cli_nodes.placement(args)
    entry = _entry_from(args)
    if opts.remote:
        opts, entry = cli_nodes.on_ray(args, opts, entry, placement)
        placement = None                  # Ray places the job's nodes itself
    run = launch(opts, entry, label=os.path.basename(entry.argv[0]), stream=True,
                 placement=placement)
    handle = RunHandle(run, background=False)
    try:
        return _follow(handle)
    finally:
        cli_torchrun.write_log_dir(args, run)


class _StopSignal(BaseException):
    """SIGTERM, SIGHUP or SIGQUIT to ``gpulaunch run``: the run ends as on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals():
    """What torchrun does: a SIGTERM (Slurm's scancel or time limit, ``kill``), SIGHUP or
    SIGQUIT to the launcher stops every rank (SIGTERM, the grace period, SIGKILL), lets the
    agent record the stop, and only then exits 128 + the signal. Dying at once instead leaves
    the agent behind for the cluster to SIGKILL before it wrote the run's end. A preemption
    grace period (``--preempt-grace``) makes SIGTERM a notice instead, inside ``follow``."""
    def stop(signum, frame):
        for sig in previous:            # once: a second signal must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        raise _StopSignal(signum)
    previous = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            previous[sig] = signal.signal(sig, stop)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _follow(handle) -> int:
    """Print the ranks' output until the run ends; the exit code torchrun would give."""
    try:
        with _stop_on_signals():
            handle.follow()
    except KeyboardInterrupt:
        print("gpulaunch: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    except _StopSignal as e:
        print(f"gpulaunch: got {signal.Signals(e.signum).name}; every rank was stopped",
              file=sys.stderr)
        return 128 + e.signum
    except errors.RunError as e:
        print(f"gpulaunch: {e}", file=sys.stderr)
        code = e.exit_code
        if code is None:
            return 1
        return 128 - code if code < 0 else code
    except BaseException as e:  # a Python exception raised by the script on some rank
        rank = getattr(e, "rank", "?")
        print(f"gpulaunch: rank {rank} raised {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _runs(limit: int) -> list[RunDir]:
    root = rundir.runs_root()
    if not root.exists():
        return []
    dirs = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return [RunDir(p) for p in dirs[-limit:]]


def _state(run: RunDir) -> str:
    """A run's state as far as its files say: the caller's verdict when it wrote one (it also
    knows TIMED_OUT / CANCELLED), else the Ray job's or the agent's."""
    final = (read_json(run.path / "tracking.json", {}) or {}).get("state")
    if final:
        return final
    job = run.job()
    if job is not None:
        return str(job.state)
    status = run.status()
    if not status.state.terminal and status.agent_pid:
        from .common.procutil import pid_alive
        if not pid_alive(int(status.agent_pid)):
            return str(NodeState.DIED)   # its agent was killed without writing an end state
    return str(status.state)


def cmd_gc(args) -> int:
    """``gpulaunch runs --gc``: the retention policy now, without the per-launch bound."""
    from .common import retention
    try:
        policy = retention.Policy.from_env()
    except ValueError as e:
        print(f"gpulaunch: error: {e}", file=sys.stderr)
        return 2
    report = retention.prune(policy)
    print(f"gpulaunch: removed {len(report.removed)} run dir(s) under {rundir.runs_root()} "
          f"(kept the newest {policy.keep_runs} and those newer than {policy.keep_days:g} days: "
          f"GPULAUNCH_KEEP_RUNS / GPULAUNCH_KEEP_DAYS); {len(report.kept_active)} active, "
          f"{len(report.payloads_dropped)} payload(s) dropped")
    for err in report.errors:
        print(f"gpulaunch: could not remove {err}", file=sys.stderr)
    return 1 if report.errors else 0


def cmd_runs(args) -> int:
    if getattr(args, "gc", False):
        return cmd_gc(args)
    rows = []
    for run in _runs(args.limit):
        try:
            record = run.launch()
        except (TypeError, ValueError, KeyError):
            record = None                # a run directory of another gpulaunch version
        status = run.status()
        start = record.started if record else None
        end = status.ended
        row = (run.run_id, record.label if record else "?",
               _dt.datetime.fromtimestamp(start).strftime("%Y-%m-%d %H:%M:%S") if start else "?",
               f"{end - start:.1f}s" if start and end else "-",
               str(record.world_size) if record else "?", _state(run))
        if args.long:
            mlflow_id = status.extensions.get("mlflow_run_id") or \
                (read_json(run.path / "tracking.json", {}) or {}).get("run_id") or "-"
            row += (mlflow_id,)
        rows.append(row)
    if not rows:
        print(f"no runs under {rundir.runs_root()}")
        return 0
    header = ("RUN", "FUNCTION/SCRIPT", "STARTED", "DURATION", "WORLD", "STATUS")
    if args.long:
        header += ("MLFLOW RUN",)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def _find_run(ref: str) -> RunDir:
    root = rundir.runs_root()
    if os.path.isdir(ref):
        return RunDir(ref)
    if ref == "last":
        runs = _runs(1)
        if runs:
            return runs[0]
    matches = [p for p in root.iterdir() if p.name == ref or p.name.startswith(ref)
               or p.name.endswith(ref)] if root.exists() else []
    if len(matches) == 1:
        return RunDir(matches[0])
    raise errors.ConfigurationError(f"no single run matches {ref!r} under {root} "
                                    f"({len(matches)} match); see `gpulaunch runs`")


def cmd_logs(args) -> int:
    run = _find_run(args.run)
    record = run.launch()
    world = record.world_size if record else 1
    if args.rank is not None and not 0 <= args.rank < world:
        raise errors.ConfigurationError(f"--rank {args.rank}: run {run.run_id} has ranks "
                                        f"0..{world - 1}")
    ranks = [args.rank] if args.rank is not None else list(range(world))
    attempts = run.attempts()
    if not attempts and not args.follow:
        print("(no logs yet)")
        return 0
    if not args.follow:
        for r in ranks:
            text = tail_text(run.rank_file(attempts[-1], r, "log"), 10**9, max_bytes=1 << 26)
            for line in text.splitlines():
                print(f"[rank {r}] {line}" if args.rank is None else line)
        return 0
    streamer = LogStreamer(show=lambda r: r in ranks)
    try:
        while True:
            for a in run.attempts():
                for r in ranks:
                    streamer.watch(r, run.rank_file(a, r, "log"))
            streamer.pump()
            if state_is_terminal(_state(run)):
                streamer.pump(final=True)
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        return 130


def cmd_stacks(args) -> int:
    from .caller.stacks import collect_stacks
    run = _find_run(args.run)
    record = run.launch()
    if state_is_terminal(_state(run)):
        raise errors.ConfigurationError(f"run {run.run_id} is over ({_state(run)}): there is no "
                                        "stack to take; its logs: gpulaunch logs " + run.run_id)
    print(collect_stacks(run, record.world_size if record else 1, native=args.native or None))
    return 0


def cmd_debug(args) -> int:
    from .caller.debug_client import attach
    return attach(_find_run(args.run), args.rank, wait=args.wait)


def cmd_doctor(args) -> int:
    import platform
    host = hardware.detect()
    print(f"gpulaunch   {_version()}")
    print(f"python      {platform.python_version()} ({sys.executable})")
    try:
        import torch
        print(f"torch       {torch.__version__} (cuda build: {torch.version.cuda or 'no'})")
    except ImportError:
        print("torch       NOT INSTALLED: pip install torch")
    print(f"host        {host.describe()} [found via {host.source}]")
    for g in host.gpus:
        print(f"  gpu {g.index}: {g.name}, {g.memory_bytes / 2**30:.1f} GiB, type "
              f"{g.gpu_type.name if g.gpu_type else 'unknown'}")
    try:
        shm = shutil.disk_usage("/dev/shm").total
        warn = "  (small: DataLoader workers may fail; give the container --shm-size=8g)" \
            if shm < 1 << 30 else ""
        print(f"/dev/shm    {shm / 2**30:.1f} GiB{warn}")
    except OSError:
        print("/dev/shm    missing")
    print(f"run dirs    {rundir.runs_root()}")
    from .backends.local import standby
    print(f"standby     {'on' if standby.enabled() else 'off'}: the Python API starts the next "
          f"call's agent ahead, torch imported ({standby.ENV_SWITCH}=0 turns it off)")
    from .backends.local import pool_cli
    pools = pool_cli.lines()
    print(f"warm pools  {len(pools) or 'none'}" + ("  (gpulaunch pool list / close)" if pools
                                                     else " (keep_alive=)"))
    for line in pools:
        print(f"  {line}")
    for var in ("CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_P2P_DISABLE",
                "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT"):
        if var in os.environ:
            print(f"env         {var}={os.environ[var]}")
    if args.smoke:
        from . import runtime as rt
        from .api import distributed

        def _smoke():
            import torch
            import torch.distributed as dist
            rt.init()
            t = torch.ones(1, device=rt.device())
            dist.all_reduce(t)
            return t.item()
        n = 2 if not host.has_gpu else len(host.gpus)
        t0 = time.perf_counter()
        out = distributed(gpus=n, stream_logs="none")(_smoke).distributed()
        ok = all(v == n for v in out)
        print(f"smoke       {n} ranks, all_reduce {'OK' if ok else 'WRONG: ' + str(out)} "
              f"in {time.perf_counter() - t0:.1f} s")
        return 0 if ok else 1
    return 0


def _version() -> str:
    from . import __version__
    return __version__


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (every subcommand), without running anything: the docs' tests
    check each documented ``gpulaunch ...`` line against it."""
    parser = argparse.ArgumentParser(prog="gpulaunch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"gpulaunch {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    p = sub.add_parser("runs", help="list recent runs")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--long", "-l", action="store_true", help="also show each MLflow run id")
    p.add_argument("--gc", action="store_true",
                   help="remove old run dirs: keep the newest GPULAUNCH_KEEP_RUNS (100) and "
                        "those newer than GPULAUNCH_KEEP_DAYS (7); never a running one")
    p = sub.add_parser("logs", help="print a run's logs")
    p.add_argument("run", help="run id (or a unique prefix/suffix, or 'last')")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--follow", "-f", action="store_true")
    p = sub.add_parser("stacks", help="print every rank's current Python stack (a running run)")
    p.add_argument("run", help="run id (or a unique prefix/suffix, or 'last')")
    p.add_argument("--native", action="store_true", help="add native frames (needs py-spy)")
    p = sub.add_parser("debug", help="attach pdb to a rank stopped at its error (debug=True)")
    p.add_argument("run", help="run id (or a unique prefix/suffix, or 'last')")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the rank")
    p = sub.add_parser("doctor", help="what this host has, and whether a launch works")
    p.add_argument("--smoke", action="store_true", help="also run a 2-rank all_reduce")
    for module in _subcommands().values():
        module.add_parser(sub)
    return parser


def _subcommands() -> dict:     # the subcommands whose parser and handler live elsewhere
    from . import cli_preempt
    from .backends.local import pool_cli
    from .jobs import command as job_cli
    from .planner import command as planner
    return {"pool": pool_cli, "plan": planner, "job": job_cli, "preempt": cli_preempt}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"run": cmd_run, "runs": cmd_runs, "logs": cmd_logs, "doctor": cmd_doctor,
                "stacks": cmd_stacks, "debug": cmd_debug}
    handlers.update((name, module.main) for name, module in _subcommands().items())
    try:
        return handlers[args.command](args)
    except errors.UserError as e:
        print(f"gpulaunch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
