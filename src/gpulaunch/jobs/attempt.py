"""One attempt of a job: ``python -m gpulaunch.jobs.attempt``, started by the supervisor (this
host), by the sbatch script on every node (Slurm) or as a Ray job's entrypoint.

It runs the same pipeline as ``gpulaunch run`` (``caller.pipeline.launch``), so an attempt
has a run directory, per-rank logs, the root-cause rules and, when tracking is on, an MLflow
run with system metrics; that run is nested under the job's run through ``MLFLOW_RUN_ID``.
Its stdout is the attempt's log: every rank's lines, prefixed ``[rank N]``.

What it needs comes in one variable (``GPULAUNCH_JOB_ATTEMPT``, JSON: the resolved spec, job
id, attempt number, where to write the result), or ``@path`` of a file holding it; the result is a JSON file when the job's
folder is reachable, and always a last stdout line ``GPULAUNCH_ATTEMPT_RESULT {...}`` (a Ray
job's only channel back). SIGTERM (cancel, Slurm's scancel, Ray's stop_job) stops every rank.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time

ENV = "GPULAUNCH_JOB_ATTEMPT"
MARKER = "GPULAUNCH_ATTEMPT_RESULT "


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _function_call(spec):
    """(function, args, kwargs, names) for ``command.function``: imported from the snapshot;
    a ``@distributed`` function runs its undecorated body (the spec's settings apply)."""
    sys.path.insert(0, os.getcwd())
    module, _, name = spec.command.function.partition(":")
    fn = getattr(importlib.import_module(module), name)
    fn = getattr(fn, "func", fn)
    return fn, (), dict(spec.command.kwargs), {}


def _placement(spec):
    if spec.compute.where != "slurm":
        return None
    from .. import cli_nodes
    none = dict.fromkeys(("nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint",
                          "rdzv_id", "listen_addr"))
    return cli_nodes.placement(argparse.Namespace(**none))


def _cause(e: BaseException) -> str:
    from ..errors import RunError
    if isinstance(e, RunError):
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    rank = getattr(e, "rank", None)
    who = f"rank {rank} raised" if rank is not None else "raised"
    return f"{who} {type(e).__name__}: {e}"


def _summary(results) -> list[str]:
    return [repr(r)[:500] for r in results] if isinstance(results, list) else [repr(results)]


def run(ctx: dict) -> dict:
    from ..caller.handle import RunHandle
    from ..caller.pipeline import launch
    from .resolve import entry_for, options_for
    from .spec import JobSpec
    spec = JobSpec.from_json(ctx["spec"])
    placement = _placement(spec)
    node_rank = placement.node_rank if placement is not None else 0
    tags = {"gpulaunch.job_id": ctx["job_id"], "gpulaunch.job_attempt": str(ctx["attempt"])}
    opts = options_for(spec, tracking_tags=tags,
                       enabled=bool(ctx.get("tracking")) and node_rank == 0)
    # what a rank may want to know about its job (a checkpoint folder that outlives attempts)
    opts = opts.replace(env={**dict(opts.env), "GPULAUNCH_JOB_ID": ctx["job_id"],
                             "GPULAUNCH_ATTEMPT": str(ctx["attempt"]),
                             **({"GPULAUNCH_JOB_DIR": ctx["job_dir"]} if ctx.get("job_dir")
                                else {})})
    call = _function_call(spec) if spec.command.function else None
    out = {"state": "FAILED", "node_rank": node_rank, "started": time.time()}
    run = launch(opts, entry_for(spec), label=spec.name, call=call, stream=True,
                 placement=placement)
    handle = RunHandle(run, background=False)
    out.update(run_dir=handle.run_dir, run_id=handle.run_id)
    _write(ctx, {**out, "state": "RUNNING"}, node_rank)
    try:
        out["results"] = _summary(handle.follow())
        out["state"] = "SUCCEEDED"
    except KeyboardInterrupt:
        out.update(state="CANCELLED", cause="cancelled (SIGTERM): every rank was stopped")
    except BaseException as e:  # noqa: BLE001 - the rank's own error is the attempt's cause
        out["cause"] = _cause(e)
        out["error_type"] = type(e).__name__
        code = getattr(e, "exit_code", None)
        if code is not None:
            out["exit_code"] = code
    out["mlflow_run_id"] = handle.mlflow_run_id
    out["ended"] = time.time()
    return out


def _write(ctx: dict, out: dict, node_rank: int) -> None:
    path = ctx.get("result_file")
    if path and node_rank == 0:
        from pathlib import Path

        from ..common.rundir import write_json_atomic
        write_json_atomic(Path(path), out)


def main() -> int:
    raw = os.environ.pop(ENV, None)
    if not raw:
        print(f"{ENV} is not set: this module is started by a job's supervisor",
              file=sys.stderr)
        return 2
    if raw.startswith("@"):                      # a file in the job's folder (0600)
        with open(raw[1:]) as f:
            raw = f.read()
    ctx = json.loads(raw)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    for var, value in (ctx.get("environ") or {}).items():
        os.environ[var] = value                 # MLflow parent run and store
    try:
        out = run(ctx)
    except KeyboardInterrupt:
        out = {"state": "CANCELLED", "cause": "cancelled before the ranks started"}
    except BaseException as e:  # noqa: BLE001 - reported as the attempt's cause
        out = {"state": "FAILED", "cause": f"the attempt could not start: "
                                           f"{type(e).__name__}: {e}",
               "error_type": type(e).__name__}
    node_rank = out.get("node_rank", 0)
    _write(ctx, out, node_rank)
    sys.stdout.flush()
    print(MARKER + json.dumps(out, default=str), flush=True)
    return {"SUCCEEDED": 0, "CANCELLED": 130}.get(out["state"], 1)


if __name__ == "__main__":
    sys.exit(main())
