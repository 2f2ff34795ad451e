"""The job spec: one frozen, documented dataclass per YAML section, read and checked by
``from_located``. Every error names the key and its line and says what to write instead.

Two sections take their keys from elsewhere, so no setting is listed twice:
``launch:`` takes the ``LaunchOptions`` fields (every ``@distributed`` setting: ``timeout``,
``hang_timeout``, ``max_restarts``, ``plan``...) except those another section owns
(``OWNED``), and ``tracking:`` takes the ``gpulaunch.tracking.Tracking`` fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

from .. import options as launch_options
from ..errors import ConfigurationError
from .specfile import Located, SpecError

WHERE = ("local", "slurm", "ray")
_UNIONS = (typing.Union, types.UnionType)
# LaunchOptions fields that a section of the spec sets, and where to write them instead.
OWNED = {"gpus": "compute.gpus", "gpu_type": "compute.gpu_type",
         "remote": "compute.where: ray", "cluster": "compute.ray.address",
         "env": "environment.env", "tracking": "the tracking: section"}
# LaunchOptions fields that mean nothing for a detached job, and why.
NOT_FOR_JOBS = {"keep_alive": "an attempt's process ends with its run, so there is no next "
                              "call to keep ranks warm for",
                "panel": "a job has no notebook to draw a panel in",
                "replicas": "a job runs one launch per attempt; run ft.run_replicas from the "
                            "job's script for replica groups"}


def item(default=None, doc: str = "", *, check=None, factory=None):
    meta = {"doc": doc, "check": check}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _positive(v):
    if v < 1:
        raise ValueError("must be at least 1")
    return v


def _non_negative(v):
    if v < 0:
        raise ValueError("must be 0 or more")
    return v


def _where(v):
    if v not in WHERE:
        raise ValueError(f"must be one of {', '.join(WHERE)}")
    return v


def _name(v):
    if not v or not all(c.isalnum() or c in "-_." for c in v) or len(v) > 64:
        raise ValueError("use 1-64 letters, digits, '-', '_' or '.' (it names the job's folder "
                         "and its Slurm/Ray job)")
    return v


@dataclasses.dataclass(frozen=True)
class SlurmCompute:
    """``compute.slurm``: how the sbatch script asks Slurm for the nodes."""
    partition: str | None = item(None, "sbatch --partition")
    account: str | None = item(None, "sbatch --account")
    qos: str | None = item(None, "sbatch --qos")
    time: str | None = item(None, "sbatch --time, Slurm's wall-clock limit (e.g. '12:00:00')")
    request_gpus: bool = item(True, "ask for compute.gpus GPUs per node (--gpus-per-node); "
                              "false on a CPU partition or one that hands out whole nodes")
    sbatch: list[str] = item(doc="more #SBATCH options, as written after #SBATCH "
                             "(['--exclusive', '--mem=0'])", factory=list)


@dataclasses.dataclass(frozen=True)
class RayCompute:
    """``compute.ray``: which Ray cluster takes the job."""
    address: str | None = item(None, "the cluster's job server, e.g. 'http://head:8265' "
                               "(default: $RAY_ADDRESS)")


@dataclasses.dataclass(frozen=True)
class Compute:
    """``compute:`` where the job runs and on how much hardware."""
    where: str = item("local", "'local' (this host, a detached supervisor), 'slurm' (sbatch "
                      "from this host) or 'ray' (Ray's job submission API)", check=_where)
    gpus: int | None = item(None, "GPUs (ranks) per node; empty: every GPU of the node (2 CPU "
                            "workers on a host without GPUs)", check=_positive)
    gpu_type: str | None = item(None, "refuse to run on another GPU type ('H100', 'A100', ...)")
    nodes: int = item(1, "number of nodes (slurm and ray; local is this host only)",
                      check=_positive)
    slurm: SlurmCompute = item(doc="Slurm settings (compute.where: slurm)", factory=SlurmCompute)
    ray: RayCompute = item(doc="Ray settings (compute.where: ray)", factory=RayCompute)


@dataclasses.dataclass(frozen=True)
class Environment:
    """``environment:`` the Python the job runs in and its variables."""
    env: dict[str, str] = item(doc="environment variables for every rank", factory=dict)
    requirements: list[str] = item(
        doc="pip requirement lines; a venv with them (on top of this Python's packages) is "
        "built once per content hash and reused; on Ray, the job's runtime_env pip list",
        factory=list)
    python: str | None = item(None, "an existing interpreter to run in instead: a python "
                              "executable, or a venv/conda folder (gpulaunch must be installed "
                              "there)")


@dataclasses.dataclass(frozen=True)
class Code:
    """``code:`` the folder the job runs from, copied when the job is submitted."""
    dir: str = item(".", "folder to snapshot, relative to the spec file; the job runs from its "
                    "copy, so later edits do not change a submitted job")
    exclude: list[str] = item(doc="more .gitignore-style patterns to leave out (.gitignore "
                              "files and .git/ are always honoured)", factory=list)
    max_mb: float = item(200.0, "refuse a snapshot larger than this (MB)", check=_positive)


@dataclasses.dataclass(frozen=True)
class Command:
    """``command:`` what every rank runs: exactly one of script, module or function."""
    script: str | None = item(None, "a Python file under code.dir, run like `gpulaunch run "
                              "script.py args`")
    module: str | None = item(None, "a module, run like `python -m module args`")
    function: str | None = item(None, "'module:function' run under @distributed semantics: "
                                "every rank calls it with kwargs; rank results are saved")
    args: list[str] = item(doc="command-line arguments of the script or module", factory=list)
    kwargs: dict[str, Any] = item(doc="keyword arguments of the function", factory=dict)

    @property
    def kind(self) -> str:
        return next(k for k in ("script", "module", "function") if getattr(self, k))


@dataclasses.dataclass(frozen=True)
class Retry:
    """``retry:`` a failed attempt is started again, after a growing pause."""
    max_retries: int = item(0, "attempts after the first (each a nested MLflow run)",
                            check=_non_negative)
    backoff: float = item(10.0, "seconds before the first retry", check=_non_negative)
    backoff_factor: float = item(2.0, "each further pause is this many times longer",
                                 check=_positive)
    max_backoff: float = item(600.0, "longest pause (seconds)", check=_non_negative)

    def pause(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1, 2, ...)."""
        return min(self.max_backoff, self.backoff * self.backoff_factor ** (retry - 1))


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """A job: what runs, where, in which environment, how often it may fail."""
    name: str = item(None, "the job's name (required)", check=_name)
    command: Command = item(doc="what every rank runs (required)", factory=Command)
    compute: Compute = item(doc="where and on how much hardware", factory=Compute)
    environment: Environment = item(doc="Python and environment variables", factory=Environment)
    code: Code = item(doc="the code snapshot", factory=Code)
    retry: Retry = item(doc="retries with backoff", factory=Retry)
    tracking: dict[str, Any] = item(doc="the MLflow runs: any gpulaunch.tracking.Tracking field "
                                    "(experiment, tags, tracking_uri, ...)", factory=dict)
    launch: dict[str, Any] = item(doc="any @distributed setting (LaunchOptions) not set above: "
                                  "timeout, hang_timeout, max_restarts, plan, ...", factory=dict)
    spec_dir: str = item(".", "(set from the spec file's folder, not written)")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "JobSpec":
        return _build(cls, data, "", None)

    @property
    def code_dir(self) -> Path:
        return (Path(self.spec_dir) / self.code.dir).resolve()


# ----------------------------------------------------------------------------- reading
def launch_keys() -> dict[str, dataclasses.Field]:
    """The keys ``launch:`` takes: LaunchOptions fields not owned by another section."""
    return {f.name: f for f in dataclasses.fields(launch_options.LaunchOptions)
            if f.name not in OWNED and f.name not in NOT_FOR_JOBS}


def tracking_keys() -> dict[str, dataclasses.Field]:
    from ..tracking.settings import Tracking
    return {f.name: f for f in dataclasses.fields(Tracking)}


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in _UNIONS:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " (or empty)"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}s"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a section (a mapping)"
    return {str: "text", int: "an integer", float: "a number", bool: "true or false",
            Any: "any value"}.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(tp, value, path: str, loc: Located | None):
    """``value`` as type ``tp``, or a SpecError at ``path``."""
    origin = typing.get_origin(tp)
    if origin in _UNIONS:
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(inner, value, path, loc)
    if dataclasses.is_dataclass(tp):
        if value is None:
            return tp()
        return _build(tp, value, path, loc)
    bad = False
    if tp is Any:
        return value
    if origin is list:
        if value is None:
            return []
        if not isinstance(value, list):
            bad = True
        else:
            return [_convert(typing.get_args(tp)[0], v, f"{path}[{i}]", loc)
                    for i, v in enumerate(value)]
    elif origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            bad = True
        else:
            kt, vt = typing.get_args(tp)
            if vt is str:   # environment variables: numbers written bare are meant as text
                return {k: _scalar_text(v, f"{path}.{k}", loc) for k, v in value.items()}
            return dict(value)
    elif tp is bool:
        bad = not isinstance(value, bool)
    elif tp is int:
        bad = isinstance(value, bool) or not isinstance(value, int)
    elif tp is float:
        bad = isinstance(value, bool) or not isinstance(value, (int, float))
        value = value if bad else float(value)
    elif tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        bad = not isinstance(value, str)
    if bad:
        raise _error(loc, path, f"expected {_type_name(tp)}, got {value!r}")
    return value


def _scalar_text(v, path, loc) -> str:
    if isinstance(v, (dict, list)) or v is None:
        raise _error(loc, path, f"expected text, got {v!r}")
    return str(v).lower() if isinstance(v, bool) else str(v)


def _error(loc: Located | None, path: str, message: str) -> SpecError:
    return loc.error(path, message) if loc is not None else SpecError(f"{path}: {message}")


def _unknown(loc, path: str, key: str, known) -> SpecError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    where = f"{path}.{key}" if path else key
    return _error(loc, where, f"unknown key; {hint}known here: {', '.join(sorted(known))}")


def _build(cls, data, path: str, loc: Located | None):
    if not isinstance(data, dict):
        raise _error(loc, path or "spec", f"expected a section (a mapping), got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields or (cls is JobSpec and key == "spec_dir" and loc is not None):
            raise _unknown(loc, path, key, [k for k in fields if k != "spec_dir"])
        where = f"{path}.{key}" if path else key
        converted = _convert(hints[key], value, where, loc)
        check = fields[key].metadata.get("check")
        if check is not None and converted is not None:
            try:
                converted = check(converted)
            except (ValueError, ConfigurationError) as e:
                raise _error(loc, where, f"{e} (got {value!r})") from None
        kwargs[key] = converted
    return cls(**kwargs)


def _check_section(loc: Located, section: str, values: dict, keys: dict) -> None:
    """Each key of ``launch:`` / ``tracking:`` on its own, so an error names it."""
    for key, value in values.items():
        where = f"{section}.{key}"
        if section == "launch" and key in OWNED:
            raise loc.error(where, f"set {OWNED[key]} instead")
        if section == "launch" and key in NOT_FOR_JOBS:
            raise loc.error(where, f"not for jobs: {NOT_FOR_JOBS[key]}")
        if key not in keys:
            raise _unknown(loc, section, key, keys)
        check = keys[key].metadata.get("check")
        try:
            if check is not None:
                check(value)
            elif section == "tracking":
                from ..tracking.settings import normalize
                normalize({key: value})
        except (ConfigurationError, ValueError, TypeError) as e:
            raise loc.error(where, str(e)) from None


def from_located(loc: Located, spec_dir: str | Path = ".") -> JobSpec:
    """The spec, each section checked on its own (``resolve.load`` adds the checks across
    sections and against the files and the host)."""
    data = loc.data
    for required in ("name", "command"):
        if data.get(required) in (None, "", {}):
            raise SpecError(f"{loc.source}: {required}: is missing; a job needs a name: and a "
                            "command: (script:, module: or function:)")
    spec = _build(JobSpec, data, "", loc)
    spec = dataclasses.replace(spec, spec_dir=str(Path(spec_dir).resolve()))
    _check_section(loc, "launch", spec.launch, launch_keys())
    _check_section(loc, "tracking", spec.tracking, tracking_keys())
    return spec
