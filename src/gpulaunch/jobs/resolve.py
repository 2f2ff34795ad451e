"""From a checked spec to what the launch pipeline takes (``LaunchOptions``, ``Entry``), and
the checks that span sections or look at files and the host: a script that is not there, a
GPU count this host cannot give, a Ray job without an address. All run before anything starts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .. import options as launch_options
from ..common.records import Entry
from ..errors import ConfigurationError, UserError
from . import specfile
from .spec import JobSpec, from_located
from .specfile import Located, SpecError


def load(path: str | Path, overrides: list[str] | tuple = ()) -> JobSpec:
    """Read, override and check a spec file: every error before anything starts."""
    loc = specfile.load(path)
    for item in overrides:
        specfile.apply_override(loc, item)
    spec = from_located(loc, Path(path).resolve().parent)
    check_spec(spec, loc)
    return spec


def _err(loc: Located | None, path: str, message: str) -> SpecError:
    return loc.error(path, message) if loc is not None else SpecError(f"{path}: {message}")


def total_gpus(spec: JobSpec) -> int | None:
    c = spec.compute
    return None if c.gpus is None else c.gpus * c.nodes


def options_for(spec: JobSpec, *, tracking_tags: dict | None = None,
                enabled: bool | None = None) -> launch_options.LaunchOptions:
    """The ``LaunchOptions`` of one attempt: compute, environment and tracking sections mapped
    onto their fields, ``launch:`` passed through by name."""
    from ..tracking.settings import Tracking
    c = spec.compute
    t = dict(spec.tracking)
    t["tags"] = {**(t.get("tags") or {}), **(tracking_tags or {})}
    if enabled is not None and t.get("enabled") is None:
        t["enabled"] = enabled
    t.setdefault("run_name", spec.name)
    kwargs = dict(spec.launch)
    kwargs.update(gpus=total_gpus(spec) if c.where == "ray" else c.gpus, gpu_type=c.gpu_type,
                  env=dict(spec.environment.env), tracking=Tracking(**t))
    if c.where == "ray":
        kwargs.update(remote=True, cluster="auto")      # inside the Ray job: its own cluster
    return launch_options.build(**kwargs)


def entry_for(spec: JobSpec) -> Entry:
    cmd = spec.command
    if cmd.script:
        return Entry("script", (cmd.script, *cmd.args))
    if cmd.module:
        return Entry("module", (cmd.module, *cmd.args))
    return Entry("function")


def _check_command(spec: JobSpec, loc) -> None:
    cmd = spec.command
    given = [k for k in ("script", "module", "function") if getattr(cmd, k)]
    if len(given) != 1:
        what = "none" if not given else " and ".join(given)
        raise _err(loc, "command", f"give exactly one of script:, module: or function: "
                   f"(got {what})")
    code = spec.code_dir
    if cmd.script:
        path = Path(cmd.script)
        if path.is_absolute() or ".." in path.parts:
            raise _err(loc, "command.script", f"{cmd.script!r} must be a path inside code.dir "
                       f"({code}): the job runs from a copy of that folder")
        if not (code / path).is_file():
            raise _err(loc, "command.script", f"{cmd.script!r} is not a file under code.dir "
                       f"({code})")
    if cmd.function:
        mod, sep, fn = cmd.function.partition(":")
        if not sep or not mod or not fn.isidentifier():
            raise _err(loc, "command.function", f"write 'module:function' (e.g. "
                       f"'train:main'), got {cmd.function!r}")
    if cmd.kwargs and not cmd.function:
        raise _err(loc, "command.kwargs", "kwargs are for command.function; a script or module "
                   "takes command.args")
    if cmd.function and cmd.args:
        raise _err(loc, "command.args", "a function takes command.kwargs, not args")


def _check_environment(spec: JobSpec, loc) -> None:
    e = spec.environment
    if e.python and e.requirements:
        raise _err(loc, "environment.requirements", "give either requirements (a venv built "
                   "for the job) or python (an environment you built), not both")
    if e.python and spec.compute.where != "ray":
        from .environment import interpreter_of
        try:
            interpreter_of(e.python)
        except ConfigurationError as ex:
            raise _err(loc, "environment.python", str(ex)) from None
    for i, line in enumerate(e.requirements):
        if not line.strip() or line.strip().startswith("-"):
            raise _err(loc, f"environment.requirements[{i}]", f"{line!r}: one requirement per "
                       "item (name, name==version, a path or URL); pip options go in PIP_* "
                       "environment variables")


def _check_compute(spec: JobSpec, loc) -> None:
    c = spec.compute
    if c.where == "local" and c.nodes > 1:
        raise _err(loc, "compute.nodes", f"{c.nodes} nodes with where: local; local runs on "
                   "this host only: use where: slurm or where: ray for several nodes")
    if c.where == "ray" and c.gpus is None:
        raise _err(loc, "compute.gpus", "a Ray job needs an explicit count of GPUs per node")
    try:
        options = options_for(spec, enabled=False)
    except UserError as e:
        raise _err(loc, "launch", str(e)) from None
    if c.where == "local":
        from ..caller.spec import resolve
        from ..hardware.host import detect
        try:
            resolve(options, detect())
        except UserError as e:
            key = "compute.gpu_type" if "gpu_type" in str(e) else "compute.gpus"
            raise _err(loc, key, str(e)) from None


def check_spec(spec: JobSpec, loc: Located | None = None) -> None:
    if not spec.code_dir.is_dir():
        raise _err(loc, "code.dir", f"{spec.code.dir!r} is not a folder (resolved to "
                   f"{spec.code_dir}; relative paths start at the spec file's folder)")
    _check_command(spec, loc)
    _check_environment(spec, loc)
    _check_compute(spec, loc)


def check_target(spec: JobSpec) -> None:
    """What only matters when the job really starts (not for --dry-run): the target's tools."""
    c = spec.compute
    if c.where == "slurm" and shutil.which("sbatch") is None:
        raise SpecError("compute.where: slurm, but sbatch is not on PATH here: submit from a "
                        "Slurm login node (or one with Slurm's client commands)")
    if c.where == "ray":
        if not (c.ray.address or os.environ.get("RAY_ADDRESS")):
            raise SpecError("compute.where: ray needs compute.ray.address (the job server, "
                            "e.g. http://head:8265) or $RAY_ADDRESS")
        try:
            import ray.job_submission  # noqa: F401
        except ImportError:
            raise SpecError("compute.where: ray needs Ray's job client: pip install "
                            "'gpulaunch[ray]'") from None
