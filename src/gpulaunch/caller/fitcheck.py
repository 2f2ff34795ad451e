"""Will it fit? The planner's memory estimate, checked against the GPUs a launch will get, before any
process starts.

The planner (``gpulaunch.planner``) predicts per-GPU memory from a model's shape and the training setup.
The launcher only knows the GPUs; the user tells it the rest with ``@distributed(plan={...})``:

    @distributed(gpus=8, gpu_type="H100",
                 plan={"model": "llama-3.1-8b", "strategy": "fsdp", "seq_len": 4096})

``check()`` then refuses the launch (``WontFitError``) when the named strategy would run out of GPU
memory, naming what would fit instead, or when nothing fits at all; with no ``strategy`` it only
refuses when nothing fits. ``"on_fail": "warn"`` turns the refusal into a warning. Minutes of model
loading followed by a CUDA out-of-memory error is exactly what this check is there to prevent.

Pure: no process, no CUDA; the host's GPU names and memory come from ``hardware.host``.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

from ..errors import ConfigurationError, WontFitError

GiB = 1 << 30
# What plan() accepts from the user; gpus_per_node / nodes / gpu / gpu_memory_bytes come from the
# launch (overriding them would check a machine other than the one the run gets).
_FROM_LAUNCH = ("gpus_per_node", "nodes")
_OWN_KEYS = ("model", "strategy", "on_fail")
# Warn when the predicted peak leaves less than this share of the GPU free: the planner is within
# ~10% on the configurations it was checked on (docs/planner.md), fragmentation varies.
TIGHT = 0.10


@dataclasses.dataclass(frozen=True)
class FitVerdict:
    strategy: str | None          # the one checked (the user's, or the planner's pick)
    fits: bool
    peak_gib: float | None        # predicted per-GPU peak of `strategy`
    gpu_gib: float
    recommended: str | None
    message: str


def _plan_parameters() -> set[str]:
    from ..planner import plan
    return set(inspect.signature(plan).parameters) - {"model"}


def validate(plan_args) -> dict | None:
    """Check the ``plan=`` setting's shape at decoration time (cheap: no model is resolved)."""
    if plan_args is None:
        return None
    if not isinstance(plan_args, dict) or "model" not in plan_args:
        raise ConfigurationError(
            "plan= takes a dict with at least 'model' (a built-in name such as 'llama-3.1-8b', a Hugging "
            "Face config path, a meta-device nn.Module or a ModelShape), e.g. plan={'model': "
            "'llama-3.1-8b', 'strategy': 'fsdp', 'seq_len': 4096}; got " + repr(plan_args)[:200])
    known = _plan_parameters() | set(_OWN_KEYS)
    unknown = sorted(set(plan_args) - known)
    if unknown:
        raise ConfigurationError(f"plan= got unknown key(s) {unknown}; known: {sorted(known - set(_FROM_LAUNCH))}")
    taken = sorted(set(plan_args) & set(_FROM_LAUNCH))
    if taken:
        raise ConfigurationError(f"plan= must not set {taken}: the launch's own GPUs are what is checked")
    if plan_args.get("mesh") is not None:
        from ..planner.mesh import resolve_mesh
        try:   # names and sizes now; whether they fill the GPUs is checked at launch
            _check_mesh_shape(plan_args["mesh"], resolve_mesh)
        except ValueError as e:
            raise ConfigurationError(f"plan['mesh']: {e}") from None
    if plan_args.get("on_fail", "raise") not in ("raise", "warn"):
        raise ConfigurationError(f"plan['on_fail'] must be 'raise' or 'warn', got {plan_args['on_fail']!r}")
    strategy = plan_args.get("strategy")
    if strategy is not None:
        from ..planner import STRATEGIES
        base = str(strategy).lower().split("+", 1)[0]
        if base not in STRATEGIES:
            raise ConfigurationError(f"plan['strategy']={strategy!r}: use one of {', '.join(STRATEGIES)} "
                                     "(optionally +offload), or leave it out to check that anything fits")
    return dict(plan_args)


def _check_mesh_shape(mesh, resolve_mesh) -> None:
    """The mesh's names and sizes, resolved against the world its own sizes make (shard=-1 as 1)."""
    sizes = mesh if isinstance(mesh, dict) else None
    if isinstance(mesh, str):
        sizes = {k.strip(): v for k, _, v in (i.partition("=") for i in mesh.split(","))}
    if sizes is None:
        resolve_mesh(mesh, 1)
        return
    world = 1
    for k, v in sizes.items():
        try:
            world *= max(1, int(v))
        except (TypeError, ValueError):
            raise ValueError(f"mesh size {k}={v!r} is not an integer") from None
    resolve_mesh(mesh, world)


def check(plan_args: dict | None, *, gpus_per_node: int, nodes: int, gpu_name: str | None,
          gpu_memory_bytes: int | None) -> FitVerdict | None:
    """Run the planner for the launch's GPUs. Returns None when there is nothing to check against (no
    ``plan=``, or CPU workers); raises ``WontFitError`` when it does not fit (unless on_fail='warn')."""
    if plan_args is None or (gpu_name is None and gpu_memory_bytes is None):
        return None
    from ..hardware.catalog import model_for
    from ..planner import plan as run_plan

    try:
        model_for(gpu_name or "")
    except ValueError:
        if gpu_memory_bytes is None:
            warnings.warn(f"plan= was given but the planner does not know the GPU {gpu_name!r}: the memory "
                          "check was skipped", stacklevel=3)
            return None
        gpu_name = None  # unknown model: the planner uses the memory given and H100-like speed
    args = {k: v for k, v in plan_args.items() if k not in _OWN_KEYS}
    strategy = plan_args.get("strategy")
    try:
        p = run_plan(plan_args["model"], gpus_per_node=gpus_per_node, nodes=nodes, gpu=gpu_name,
                     gpu_memory_bytes=gpu_memory_bytes, **args)
    except (ValueError, TypeError) as e:
        raise ConfigurationError(f"plan=: {e}") from None
    gpu_gib = p.gpu_memory_bytes / GiB
    where = f"{p.world_size} x {p.gpu} ({gpu_gib:.0f} GiB)"
    if p.mesh is not None:
        from ..planner.mesh import label
        where += f" as a mesh of {label(p.mesh)}"
    if strategy is None:
        if p.fits:
            pick = p.estimate(p.recommended, p.recommended_offload)
            v = FitVerdict(pick.key, True, pick.peak_device / GiB, gpu_gib, pick.key,
                           f"fits on {where}: {p.reason}")
        else:
            v = FitVerdict(None, False, None, gpu_gib, None, f"nothing fits on {where}: {p.reason}")
    else:
        base, _, off = str(strategy).lower().partition("+")
        try:
            est = p.estimate(base, bool(off))
        except KeyError:
            raise ConfigurationError(f"plan=: strategy {strategy!r} cannot run on {where}; it takes "
                                     f"{', '.join(sorted({e.key for e in p.estimates}))}") from None
        rec = (p.recommended + ("+offload" if p.recommended_offload else "")) if p.fits else None
        if est.fits:
            msg = (f"{est.key} fits on {where}: predicted peak {est.peak_device / GiB:.1f} GiB per GPU")
            if rec and rec != est.key:
                msg += f" (the planner would pick {rec}: {p.reason})"
        else:
            instead = f"{rec} would ({p.reason})" if rec else f"nothing fits ({p.reason})"
            msg = (f"{est.key} does not fit on {where}: predicted peak {est.peak_device / GiB:.1f} GiB per GPU "
                   f"(parameters {est.parameters / GiB:.1f}, gradients {est.gradients / GiB:.1f}, optimizer "
                   f"{est.optimizer / GiB:.1f}, activations {est.activations / GiB:.1f}); {instead}")
        v = FitVerdict(est.key, est.fits, est.peak_device / GiB, gpu_gib, rec, msg)
    if not v.fits:
        text = (f"{v.message}. Nothing was started. Change the strategy or setup, use more GPUs, or pass "
                "plan={..., 'on_fail': 'warn'} to launch anyway.")
        if plan_args.get("on_fail", "raise") == "raise":
            raise WontFitError(text)
        warnings.warn(text, stacklevel=3)
    elif v.peak_gib is not None and v.peak_gib > (1 - TIGHT) * gpu_gib:
        warnings.warn(f"{v.message}: less than {TIGHT:.0%} headroom; an out-of-memory error is possible",
                      stacklevel=3)
    return v


def check_launch(plan_args: dict | None, spec, host) -> FitVerdict | None:
    """``check()`` for a resolved ``LaunchSpec``: the GPUs of this host (the smallest, if they differ),
    or, for ``remote=True``, the requested ``gpu_type``'s catalogue memory. CPU workers: nothing to check."""
    if plan_args is None or spec.device != "cuda":
        return None
    if spec.remote or not host.has_gpu:
        if spec.gpu_type is None:
            warnings.warn("plan= was given but the GPU type is unknown (remote=True without gpu_type=): "
                          "the memory check was skipped", stacklevel=3)
            return None
        return check(plan_args, gpus_per_node=spec.nproc_per_node, nodes=spec.nnodes,
                     gpu_name=spec.gpu_type.name, gpu_memory_bytes=None)
    gpus = host.gpus[:spec.nproc_per_node]
    smallest = min(gpus, key=lambda g: g.memory_bytes)
    return check(plan_args, gpus_per_node=spec.nproc_per_node, nodes=spec.nnodes, gpu_name=smallest.name,
                 gpu_memory_bytes=smallest.memory_bytes)


def parse_plan(text: str) -> dict:
    """'model=llama-3.1-8b,strategy=fsdp,seq_len=4096' -> the plan= dict."""
    out: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigurationError(f"--plan takes KEY=VALUE pairs separated by commas, e.g. "
                                     f"model=llama-3.1-8b,strategy=fsdp; got {item!r}")
        raw = raw.strip()
        v: Any = raw.lower() == "true" if raw.lower() in ("true", "false") else raw
        if isinstance(v, str):
            try:
                v = int(raw)
            except ValueError:
                pass
        out[key.strip().replace("-", "_")] = v
    return out
