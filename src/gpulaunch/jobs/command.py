"""``gpulaunch job``: run a YAML job spec detached, and list, inspect, follow or cancel jobs.

    gpulaunch job run spec.yaml [--watch] [--dry-run] [--override key=value ...]
                                [--idempotency-key K] [--json]
    gpulaunch job list [--json]
    gpulaunch job get ID [--json]
    gpulaunch job logs ID [-f] [--rank N] [--attempt N] [--json]
    gpulaunch job cancel ID [--json]

``--json`` prints one JSON document (``logs --json``: one object per line) for scripts and
coding agents. Exit codes: 0 done / succeeded, 1 the job failed, 2 a bad spec or command,
130 cancelled.
"""

from __future__ import annotations

import json
import os
import sys
import time

from ..errors import UserError
from . import follow as follow_mod
from . import resolve, store
from .store import JobDir, JobState

CANCEL_WAIT_S = 120.0


def add_parser(sub) -> None:
    p = sub.add_parser("job", help="run a YAML job spec detached (this host, Slurm or Ray); "
                       "list, get, logs, cancel", description=__doc__.split("\n\n")[0])
    jobs = p.add_subparsers(dest="job_command", required=True)
    r = jobs.add_parser("run", help="submit a job spec; it runs detached")
    r.add_argument("spec", help="the job's YAML file")
    r.add_argument("--watch", action="store_true", help="follow the job's logs to its end")
    r.add_argument("--dry-run", action="store_true",
                   help="print the resolved spec and what would start; start nothing")
    r.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="change a spec value (compute.gpus=4, launch.timeout=600); repeatable")
    r.add_argument("--idempotency-key", default=None, metavar="KEY",
                   help="a key already used returns its job instead of starting another")
    r.add_argument("--json", action="store_true")
    li = jobs.add_parser("list", help="jobs on this host, oldest first")
    li.add_argument("--limit", type=int, default=50)
    li.add_argument("--json", action="store_true")
    g = jobs.add_parser("get", help="a job's state and every attempt's cause")
    g.add_argument("job_id", help="job id, a unique prefix of it, or 'last'")
    g.add_argument("--json", action="store_true")
    lg = jobs.add_parser("logs", help="a job's logs (every attempt, [rank N] prefixes)")
    lg.add_argument("job_id")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    lg.add_argument("--rank", type=int, default=None, help="only this rank, without prefix")
    lg.add_argument("--attempt", type=int, default=None, help="only this attempt")
    lg.add_argument("--json", action="store_true", help="one JSON object per line")
    c = jobs.add_parser("cancel", help="stop a job; returns once nothing of it runs")
    c.add_argument("job_id")
    c.add_argument("--json", action="store_true")


def _print_json(data) -> None:
    print(json.dumps(data, indent=1, default=str))


# ------------------------------------------------------------------------------ views
def _supervisor_alive(rec: dict) -> bool:
    pid = rec.get("supervisor_pid")
    if not pid:
        return False
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
    except OSError:
        return False
    return "gpulaunch.jobs.supervisor" in cmd and rec.get("job_id", "") in cmd


def state_of(job: JobDir) -> str:
    """The job's state; LOST when it is not over but its supervisor is gone."""
    rec = job.record()
    state = JobState(rec.get("state", "SUBMITTED"))
    if not state.terminal and rec.get("supervisor_pid") and not _supervisor_alive(rec):
        return "LOST"
    return state.value


def describe(job: JobDir) -> dict:
    rec = job.record()
    attempts = []
    for a in (job.attempt_live(a["attempt"]) for a in job.attempts()):
        attempts.append({k: a.get(k) for k in (
            "attempt", "state", "cause", "started", "ended", "mlflow_run_id", "run_dir",
            "slurm_job_id", "ray_submission_id", "results", "exit_code") if a.get(k) is not None})
    return {"job_id": job.job_id, "name": rec.get("name"), "state": state_of(job),
            "where": rec.get("where"), "submitted": rec.get("submitted"),
            "ended": rec.get("ended"), "cause": rec.get("cause"),
            "attempts": attempts, "max_attempts": rec.get("max_attempts"),
            "mlflow_run_id": rec.get("mlflow_run_id"), "code_hash": rec.get("code_hash"),
            "idempotency_key": rec.get("idempotency_key"), "job_dir": str(job.path)}


def _when(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


# ------------------------------------------------------------------------------ run
def _dry_run(spec, args) -> int:
    import yaml

    from . import snapshot
    from .targets import for_spec
    files = snapshot.list_files(spec.code_dir, spec.code.exclude)
    digest = snapshot.content_hash(spec.code_dir, files)
    ctx = {"spec": spec.to_json(), "job_id": f"{spec.name}-<id>", "attempt": 1,
           "cwd": str(snapshot.snapshots_root() / digest), "tracking": None, "environ": {}}
    target = for_spec(spec, JobDir(store.jobs_root() / ctx["job_id"]))
    plan = target.plan(ctx)
    if args.json:
        _print_json({"dry_run": True, "spec": spec.to_json(), "code_files": len(files),
                     "code_hash": digest, "would_start": plan})
        return 0
    print("# resolved spec (nothing was started)")
    print(yaml.safe_dump(spec.to_json(), sort_keys=False).rstrip())
    print(f"# code: {len(files)} file(s) from {spec.code_dir}, content hash {digest}")
    print(f"# would start ({spec.retry.max_retries + 1} attempt(s) at most):")
    print(plan)
    return 0


def cmd_run(args) -> int:
    from . import snapshot
    from .supervisor import spawn
    spec = resolve.load(args.spec, args.override)
    if args.dry_run:
        return _dry_run(spec, args)
    job_id = store.new_job_id(spec.name)
    key = args.idempotency_key
    if key is not None:
        held = store.claim_key(key, job_id)
        if held is not None:
            if args.json:
                _print_json({"job_id": held, "existing": True, "idempotency_key": key})
            else:
                print(f"gpulaunch: idempotency key {key!r} belongs to job {held}; nothing new "
                      "was started", file=sys.stderr)
                print(held)
            return _watch(store.find(held)) if args.watch else 0
    try:
        resolve.check_target(spec)
        digest, path, count = snapshot.take(spec.code_dir, exclude=spec.code.exclude,
                                            max_mb=spec.code.max_mb)
        job = store.create(spec, job_id=job_id, key=key,
                           extra={"code_hash": digest, "code_path": str(path),
                                  "code_files": count, "spec_file": os.path.abspath(args.spec)})
    except BaseException:
        if key is not None:
            store.release_key(key, job_id)
        raise
    pid = spawn(job)
    if args.json:
        _print_json({"job_id": job.job_id, "existing": False, "state": job.state().value,
                     "supervisor_pid": pid, "job_dir": str(job.path)})
    else:
        print(f"gpulaunch: job {job.job_id} submitted ({spec.compute.where}); "
              f"follow it with `gpulaunch job logs -f {job.job_id}`", file=sys.stderr)
        print(job.job_id)
    return _watch(job) if args.watch else 0


def _watch(job: JobDir) -> int:
    try:
        state = follow_mod.follow(job)
    except KeyboardInterrupt:
        print(f"gpulaunch: stopped watching; the job goes on (`gpulaunch job cancel "
              f"{job.job_id}` stops it)", file=sys.stderr)
        return 130
    return {JobState.SUCCEEDED: 0, JobState.CANCELLED: 130}.get(state, 1)


# ------------------------------------------------------------------------------ inspect
def cmd_list(args) -> int:
    jobs = store.all_jobs()[-args.limit:]
    rows = [describe(j) for j in jobs]
    if args.json:
        _print_json(rows)
        return 0
    if not rows:
        print(f"no jobs under {store.jobs_root()}")
        return 0
    table = [("JOB", "WHERE", "STATE", "ATTEMPTS", "SUBMITTED")]
    for r in rows:
        table.append((r["job_id"], r["where"] or "?", r["state"],
                      f"{len(r['attempts'])}/{r['max_attempts']}", _when(r["submitted"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def cmd_get(args) -> int:
    d = describe(store.find(args.job_id))
    if args.json:
        _print_json(d)
        return 0
    print(f"job       {d['job_id']} ({d['name']})")
    print(f"state     {d['state']}" + (f": {d['cause']}" if d["cause"] else ""))
    print(f"where     {d['where']}")
    print(f"submitted {_when(d['submitted'])}   ended {_when(d['ended'])}")
    if d["mlflow_run_id"]:
        print(f"mlflow    run {d['mlflow_run_id']} (each attempt a nested run)")
    print(f"attempts  {len(d['attempts'])} of at most {d['max_attempts']}")
    for a in d["attempts"]:
        line = f"  {a['attempt']}: {a.get('state', '?')}"
        if a.get("cause"):
            line += f" - {a['cause'].splitlines()[0]}"
        for k in ("slurm_job_id", "ray_submission_id", "mlflow_run_id"):
            if a.get(k):
                line += f"  [{k.replace('_', ' ')} {a[k]}]"
        print(line)
    return 0


def cmd_logs(args) -> int:
    job = store.find(args.job_id)
    if args.json:
        def write(line):
            print(json.dumps({"job_id": job.job_id, "line": line}), flush=True)
    else:
        def write(line):
            print(line, flush=True)
    if args.follow:
        try:
            follow_mod.follow(job, rank=args.rank, attempt=args.attempt, write=write)
        except KeyboardInterrupt:
            return 130
        return 0
    for line in follow_mod.lines(job, attempt=args.attempt, rank=args.rank):
        write(line)
    return 0


# ------------------------------------------------------------------------------ cancel
def cmd_cancel(args) -> int:
    import signal
    job = store.find(args.job_id)
    rec = job.record()
    if JobState(rec.get("state", "SUBMITTED")).terminal:
        out = {"job_id": job.job_id, "state": rec["state"], "changed": False}
    else:
        job.cancel_file.touch(mode=0o600)
        if _supervisor_alive(rec):
            os.kill(int(rec["supervisor_pid"]), signal.SIGTERM)
            deadline = time.monotonic() + CANCEL_WAIT_S
            # until the supervisor is gone, not only until it wrote an end state: it still ends
            # the job's MLflow run after that, and cancel promises that nothing is left running
            while _supervisor_alive(job.record()):
                if time.monotonic() > deadline:
                    raise UserError(f"job {job.job_id} did not stop within {CANCEL_WAIT_S:g} s;"
                                    f" see {job.supervisor_log}")
                time.sleep(0.1)
        if not job.state().terminal:        # its supervisor is gone: stop what it started
            from .targets import for_spec
            for_spec(job.spec(), job).stop_recorded(job.record().get("attempt"))
            job.update(state=JobState.CANCELLED.value, ended=time.time(),
                       cause="cancelled (its supervisor was gone)")
        out = {"job_id": job.job_id, "state": job.state().value, "changed": True}
    if args.json:
        _print_json(out)
    else:
        print(f"gpulaunch: job {out['job_id']} {out['state']}"
              + ("" if out["changed"] else " (it had already ended)"))
    return 0


HANDLERS = {"run": cmd_run, "list": cmd_list, "get": cmd_get, "logs": cmd_logs,
            "cancel": cmd_cancel}


def main(args) -> int:
    return HANDLERS[args.job_command](args)
