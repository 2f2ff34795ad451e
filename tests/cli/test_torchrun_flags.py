"""``gpulaunch run`` takes torchrun's whole command line: the flag list comes from torchrun's own
parser (torch.distributed.run), so a flag added to torchrun fails here until gpulaunch either
maps it or refuses it with a reason. Pure parsing: no process is started."""

from __future__ import annotations

import argparse

import pytest
from torch.distributed.run import get_args_parser

from gpulaunch import cli, cli_torchrun, errors, options
from gpulaunch.caller import logstream
from gpulaunch.tracking import Tracking

pytestmark = pytest.mark.unit

# a value torchrun itself would accept, per flag that takes one
SAMPLE = {"nnodes": "1", "nproc_per_node": "2", "rdzv_backend": "c10d",
          "rdzv_endpoint": "localhost:5972", "rdzv_id": "101", "rdzv_conf": "join_timeout=30",
          "max_restarts": "1", "monitor_interval": "0.1", "start_method": "spawn",
          "event_log_handler": "null", "role": "trainer", "log_dir": "/tmp/x", "redirects": "3",
          "tee": "0:1,1:2", "log_line_prefix_template": "${rank}> ", "local_ranks_filter": "0",
          "duplicate_stdout_filters": "loss", "duplicate_stderr_filters": "warn",
          "node_rank": "0", "master_addr": "127.0.0.1", "master_port": "29511",
          "local_addr": "127.0.0.1", "logs_specs": "x", "numa_binding": "node",
          "signals_to_handle": "SIGTERM,SIGINT", "shutdown_timeout": "7",
          "print_completion": "bash"}


def torchrun_actions():
    return [a for a in get_args_parser()._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpulaunch")
    cli._add_run(parser.add_subparsers(dest="command"))
    return parser


def parse(*argv):
    return run_parser().parse_args(["run", *argv, "train.py", "--lr", "3"])


def test_every_torchrun_flag_in_every_spelling_is_known():
    known = run_parser()._subparsers._group_actions[0].choices["run"]._option_string_actions
    missing = [s for a in torchrun_actions() for s in a.option_strings if s not in known]
    assert not missing, f"torchrun flags gpulaunch run does not know: {missing}"


@pytest.mark.parametrize("action", torchrun_actions(), ids=lambda a: a.dest)
def test_each_flag_has_torchruns_meaning_or_says_why_not(action, monkeypatch):
    monkeypatch.setenv("GPULAUNCH_START_METHOD", "fork")   # restored after the test
    monkeypatch.delenv("GPULAUNCH_START_METHOD")
    for spelling in action.option_strings:
        takes_value = action.nargs != 0
        argv = [spelling, SAMPLE[action.dest]] if takes_value else [spelling]
        args = parse(*argv)
        assert args.target == ["train.py", "--lr", "3"]   # the script's own args untouched
        opts = options.from_cli(args, tracking=Tracking(enabled=False))
        if action.dest in cli_torchrun.UNSUPPORTED:
            with pytest.raises(errors.ConfigurationError, match="not supported: .{20,}"):
                cli_torchrun.apply(args, opts)
        else:
            cli_torchrun.apply(args, opts)


def test_pytorch_examples_launch_line_parses_to_its_meaning():
    args = parse("--nnodes=1", "--nproc_per_node=2", "--rdzv_id=101",
                 "--rdzv_endpoint=localhost:5972")
    opts = cli_torchrun.apply(args, options.from_cli(args, tracking=Tracking(enabled=False)))
    assert opts.gpus == 2 and args.rdzv_id == "101" and args.rdzv_endpoint == "localhost:5972"


def test_mapped_flags_change_the_settings(monkeypatch):
    monkeypatch.setenv("GPULAUNCH_START_METHOD", "fork")   # restored after the test
    monkeypatch.delenv("GPULAUNCH_START_METHOD")
    args = parse("--max_restarts", "2", "--shutdown_timeout", "7", "--role", "trainer",
                 "--rdzv_conf", "join_timeout=15,read_timeout=60", "--start_method", "spawn",
                 "--local_ranks_filter", "1", "--redirects", "0:2", "--nproc-per-node", "cpu")
    opts = cli_torchrun.apply(args, options.from_cli(args, tracking=Tracking(enabled=False)))
    import os
    assert opts.max_restarts == 2 and opts.shutdown_grace == 7 and opts.start_timeout == 15
    assert dict(opts.env)["GPULAUNCH_ROLE"] == "trainer"
    assert opts.gpus == (os.cpu_count() or 1)
    assert os.environ["GPULAUNCH_START_METHOD"] == "spawn"
    console = logstream.CONSOLE
    assert console.hides(0, "stdout") and console.hides(0, "stderr")       # filtered out
    assert not console.hides(1, "stdout") and not console.hides(1, "stderr")
    args = parse("--redirects", "0:2")
    cli_torchrun.apply(args, options.from_cli(args, tracking=Tracking(enabled=False)))
    assert logstream.CONSOLE.hides(0, "stderr") and not logstream.CONSOLE.hides(0, "stdout")
    logstream.set_console(logstream.Console())


@pytest.mark.parametrize("argv,why", [
    (["--rdzv-backend", "etcd"], "own static rendezvous"),
    (["--start-method", "forkserver"], "forkserver is not supported"),
    (["--nnodes", "1:4"], "needs the rendezvous endpoint"),
    (["--nnodes", "1:4", "--rdzv-endpoint", "h:1", "--rdzv-backend", "static"],
     "needs a fixed --nnodes"),
    (["--redirects", "5"], "give 0, 1, 2 or 3"),
    (["--signals-to-handle", "SIGUSR1"], "stack-dump signal"),
    (["--event-log-handler", "console"], "torchelastic events"),
    (["--rdzv-conf", "bogus=1"], "not a rendezvous setting"),
])
def test_refusals_name_the_reason(argv, why):
    args = parse(*argv)
    with pytest.raises(errors.ConfigurationError, match=why):
        opts = cli_torchrun.apply(args, options.from_cli(args, tracking=Tracking(enabled=False)))
        from gpulaunch import cli_nodes
        cli_nodes.placement(args)
        del opts


def test_prefix_template_macros():
    assert cli_torchrun.render_prefix("[${role_name}${local_rank}/${rank}]:", rank=3,
                                      local_rank=1, role="trainer") == "[trainer1/3]:"
