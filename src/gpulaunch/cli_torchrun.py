"""torchrun's command line on ``gpulaunch run``: every flag of ``torchrun --help``, in both
spellings (``--nproc-per-node`` and ``--nproc_per_node``), so a launch line written for torchrun
runs unchanged.

Each flag either keeps torchrun's meaning, mapped onto gpulaunch's settings (``FLAGS``' second
column says how), or is refused with the reason (``UNSUPPORTED``). The flags that gpulaunch
already owns (``--nproc-per-node``, ``--max-restarts``, ``--nnodes``, ``--node-rank``,
``--master-addr``, ``--master-port``, ``--rdzv-endpoint``, ``--rdzv-id``, ``--rdzv-backend``,
``-m``, ``--no-python``, ``--standalone``) are declared in ``options`` / ``cli_nodes`` / ``cli``;
``tests/cli/test_torchrun_flags.py`` reads torchrun's own parser and fails when a flag of it is
missing here.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

from . import errors
from .caller import logstream

# torchrun's own defaults: a value equal to them asks for nothing gpulaunch does not do.
_DEFAULT_SIGNALS = {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"}
_RDZV_BACKENDS = {"static", "c10d"}
# --rdzv-conf keys torchrun's c10d/static rendezvous know; join_timeout is start_timeout here.
_RDZV_CONF_IGNORED = {"read_timeout", "last_call_timeout", "close_timeout", "timeout", "is_host",
                      "keep_alive_interval", "keep_alive_max_attempt", "use_libuv"}

ROLE_ENV = "GPULAUNCH_ROLE"

UNSUPPORTED = {
    "logs_specs": "gpulaunch keeps its own per-rank logs (see `gpulaunch logs`); "
                  "--log-dir writes torchrun's layout",
    "numa_binding": "gpulaunch does not pin ranks to NUMA nodes; run the ranks under numactl "
                    "with --no-python instead",
    "virtual_local_rank": "ranks see every GPU of the node and bind theirs by LOCAL_RANK "
                          "(rt.device()); set CUDA_VISIBLE_DEVICES per rank yourself if needed",
    "print_completion": "gpulaunch has no shell completion script",
}


def _dual(name: str) -> tuple[str, ...]:
    """``--log-dir`` and ``--log_dir``, as torchrun spells its flags."""
    dashed, underscored = "--" + name.replace("_", "-"), "--" + name
    return (dashed,) if dashed == underscored else (dashed, underscored)


def add_arguments(p) -> None:
    """The torchrun flags that no gpulaunch setting declares already."""
    g = p.add_argument_group("torchrun's other flags (same meaning; see `torchrun --help`)")
    S = argparse.SUPPRESS  # a flag not given stays absent from the namespace

    def add(name, *short, **kw):
        g.add_argument(*short, *_dual(name), dest=f"tr_{name}", default=S, **kw)

    add("rdzv_conf", metavar="K=V,...", help="join_timeout=S sets --start-timeout; with "
        "--nnodes MIN:MAX, last_call_timeout, keep_alive_interval and keep_alive_max_attempt "
        "tune the dynamic rendezvous as in torchrun; its other timeouts are accepted and have "
        "no effect")
    add("monitor_interval", type=float, metavar="S", help="accepted: gpulaunch's agent checks "
        "its ranks every 0.05 s")
    add("start_method", choices=["spawn", "fork", "forkserver"], help="fork (default: ranks "
        "share the agent's imported torch) or spawn (fresh interpreters); forkserver is refused")
    add("event_log_handler", metavar="NAME", help="only torchrun's default 'null': gpulaunch "
        "records a run's events in its run directory and MLflow")
    add("role", metavar="ROLE", help="the workers' role: ROLE_NAME in every rank")
    add("run_path", action="store_true", help="run the script in the rank's interpreter "
        "(runpy.run_path): what gpulaunch does for every .py script")
    add("log_dir", metavar="DIR", help="also write each rank's stdout.log and stderr.log in "
        "torchrun's layout under DIR/<rdzv_id>_<random>/attempt_<n>/<local_rank>/")
    add("redirects", "-r", metavar="SPEC", help="keep these streams off the console (they stay "
        "in the logs): 0 none, 1 stdout, 2 stderr, 3 both; or per local rank 0:1,1:2")
    add("tee", "-t", metavar="SPEC", help="accepted: the console shows every stream anyway and "
        "the logs keep them; with --log-dir they are also written there")
    add("log_line_prefix_template", metavar="TEMPLATE", help="prefix of console lines: "
        "${role_name}, ${local_rank}, ${rank}, ${hostname} (default: '[rank N] ')")
    add("local_ranks_filter", metavar="R,R", help="show only these local ranks' output on the "
        "console (the logs keep every rank's)")
    add("duplicate_stdout_filters", metavar="A,B", help="with --log-dir: lines of stdout "
        "containing any of these also go to attempt_<n>/filtered_stdout.log")
    add("duplicate_stderr_filters", metavar="A,B", help="the same for stderr "
        "(filtered_stderr.log)")
    add("local_addr", metavar="ADDR", help="this node's address for the job's connections "
        "(gpulaunch's --listen-addr)")
    add("signals_to_handle", metavar="SIG,...", help="accepted when within SIGTERM,SIGINT,"
        "SIGHUP,SIGQUIT: gpulaunch stops every rank on those")
    add("shutdown_timeout", type=float, metavar="S", help="seconds between SIGTERM and SIGKILL "
        "(gpulaunch's --shutdown-grace)")
    for name, why in UNSUPPORTED.items():
        kw = {"action": "store_true"} if name == "virtual_local_rank" else {"metavar": "X"}
        add(name, help=f"not supported: {why}", **kw)


def _given(args, name: str):
    return getattr(args, f"tr_{name}", None)


def apply(args, opts):
    """Check torchrun's flags and fold them into ``opts`` (returned); the console's filters and
    prefix go to ``caller.logstream``. Refuses a flag gpulaunch cannot honour, naming why."""
    for name, why in UNSUPPORTED.items():
        if _given(args, name):
            raise errors.ConfigurationError(f"--{name.replace('_', '-')} is not supported: {why}")
    changes: dict = {}
    env = dict(opts.env)
    backend = getattr(args, "rdzv_backend", None)
    if backend and backend not in _RDZV_BACKENDS:
        raise errors.ConfigurationError(
            f"--rdzv-backend {backend} is not supported: gpulaunch runs its own static "
            "rendezvous on node 0 (give --rdzv-endpoint or --master-addr; 'c10d' and 'static' "
            "are accepted)")
    conf = _given(args, "rdzv_conf")
    if conf:
        for item in filter(None, (x.strip() for x in conf.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise errors.ConfigurationError(f"--rdzv-conf {conf!r}: give key=value pairs")
            if key == "join_timeout":
                changes["start_timeout"] = float(value)
            elif key not in _RDZV_CONF_IGNORED:
                raise errors.ConfigurationError(
                    f"--rdzv-conf {key}=...: not a rendezvous setting gpulaunch knows "
                    f"(join_timeout, {', '.join(sorted(_RDZV_CONF_IGNORED))})")
    method = _given(args, "start_method")
    if method == "forkserver":
        raise errors.ConfigurationError("--start-method forkserver is not supported: gpulaunch "
                                        "forks its ranks (default) or spawns them (spawn)")
    if method:
        os.environ["GPULAUNCH_START_METHOD"] = method    # read by the agent we start
    handler = _given(args, "event_log_handler")
    if handler and handler != "null":
        raise errors.ConfigurationError(
            f"--event-log-handler {handler} is not supported: gpulaunch does not emit "
            "torchelastic events (its run directory and MLflow run record them)")
    signals = _given(args, "signals_to_handle")
    if signals:
        extra = {s.strip() for s in signals.split(",") if s.strip()} - _DEFAULT_SIGNALS
        if extra:
            raise errors.ConfigurationError(
                f"--signals-to-handle {','.join(sorted(extra))} is not supported: gpulaunch "
                "forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT (stopping every rank); SIGUSR1 "
                "is its stack-dump signal")
    if _given(args, "shutdown_timeout") is not None:
        changes["shutdown_grace"] = _given(args, "shutdown_timeout")
    if _given(args, "local_addr") and not getattr(args, "listen_addr", None):
        args.listen_addr = _given(args, "local_addr")
    role = _given(args, "role") or "default"
    if _given(args, "role"):
        env[ROLE_ENV] = role            # ROLE_NAME in the rank (rank.torchrun_env)
    hidden = set(parse_streams(_given(args, "redirects") or "0", "--redirects"))
    parse_streams(_given(args, "tee") or "0", "--tee")        # checked; the console shows all
    local_filter = _given(args, "local_ranks_filter")
    if local_filter:
        try:
            shown = {int(x) for x in local_filter.split(",") if x.strip()}
        except ValueError:
            raise errors.ConfigurationError(f"--local-ranks-filter {local_filter!r}: give local "
                                            "ranks, e.g. 0,1") from None
        for lr in range(_nproc(opts)):
            if lr not in shown:
                hidden |= {(lr, "stdout"), (lr, "stderr")}
    if env != dict(opts.env):
        changes["env"] = env
    if changes:
        opts = opts.replace(**changes)
    template = _given(args, "log_line_prefix_template")
    prefix = None
    if template:
        prefix = lambda r, lr: render_prefix(template, rank=r, local_rank=lr, role=role)  # noqa
    logstream.set_console(logstream.Console(frozenset(hidden), prefix, _nproc(opts)))
    return opts


def _nproc(opts) -> int:
    """Ranks per node as the launch will resolve them (the console needs local ranks)."""
    if opts.gpus is not None:
        return opts.gpus
    from .hardware import host
    h = host.detect()
    return len(h.gpus) if h.has_gpu else 2


def parse_streams(spec: str, flag: str) -> list[tuple[int | None, str]]:
    """torchrun's Std spec: ``3`` (every local rank) or ``0:1,1:2`` (per local rank) ->
    [(local_rank or None, stream)]."""
    names = {0: (), 1: ("stdout",), 2: ("stderr",), 3: ("stdout", "stderr")}

    def streams(text):
        if not text.strip().isdigit() or int(text) not in names:
            raise errors.ConfigurationError(f"{flag} {spec!r}: give 0, 1, 2 or 3, or "
                                            "LOCAL_RANK:N,... (e.g. 0:3,1:1)")
        return names[int(text)]
    spec = spec.strip()
    if ":" not in spec:
        return [(None, s) for s in streams(spec)]
    out = []
    for item in spec.split(","):
        lr, _, value = item.partition(":")
        if not lr.strip().isdigit():
            raise errors.ConfigurationError(f"{flag} {spec!r}: {lr!r} is not a local rank")
        out += [(int(lr), s) for s in streams(value)]
    return out


def render_prefix(template: str, *, rank: int, local_rank: int, role: str) -> str:
    """torchrun's ``--log-line-prefix-template`` macros."""
    import socket
    values = {"role_name": role, "rank": str(rank), "local_rank": str(local_rank),
              "hostname": socket.gethostname()}
    return re.sub(r"\$\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), template)


def write_log_dir(args, run) -> Path | None:
    """``--log-dir``: each rank's streams in torchrun's layout, split from gpulaunch's one
    ordered log per rank (stderr lines carry a marker there: ``caller.logstream``), once the run
    is over. ``run``: the launched run (its run directory and launch record)."""
    base = _given(args, "log_dir")
    if not base:
        return None
    record = run.run.launch()
    run_dir, nproc = run.run.path, record.spec.nproc_per_node
    node_rank = record.placement.node_rank
    rdzv_id = getattr(args, "rdzv_id", None) or "none"
    os.makedirs(base, exist_ok=True)
    job = Path(tempfile.mkdtemp(prefix=f"{rdzv_id}_", dir=base))
    filters = {s: [f for f in (_given(args, f"duplicate_{s}_filters") or "").split(",") if f]
               for s in ("stdout", "stderr")}
    for attempt_dir in sorted(Path(run_dir).glob("attempt*")):
        n = attempt_dir.name.removeprefix("attempt")
        out_dir = job / f"attempt_{n}"
        filtered = {s: [] for s in filters}
        ranks = [node_rank * nproc + lr for lr in range(nproc)]
        if record.placement.elastic:      # node ranks come from each round's rendezvous
            ranks = sorted(int(m.group(1)) for m in (re.fullmatch(r"rank(\d+)\.log", f.name)
                                                     for f in attempt_dir.iterdir()) if m)
        for rank in ranks:
            lr = rank % nproc
            src = attempt_dir / f"rank{rank}.log"
            if not src.exists():
                continue
            streams = logstream.split_streams(src)
            (out_dir / str(lr)).mkdir(parents=True, exist_ok=True)
            for s, data in streams.items():
                (out_dir / str(lr) / f"{s}.log").write_bytes(data)
                filtered[s] += [line for line in data.splitlines(keepends=True)
                                if any(f.encode() in line for f in filters[s])]
        for s, lines in filtered.items():
            if filters[s]:
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / f"filtered_{s}.log").write_bytes(b"".join(lines))
    print(f"gpulaunch: rank logs written under {job}", file=sys.stderr)
    return job
