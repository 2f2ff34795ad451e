"""The caller's settings of a fault-tolerant run, checked before anything starts: a bad value
fails here with its name, not minutes later inside a replica group's launch."""

from __future__ import annotations

from ..errors import ConfigurationError

# launch settings run_replicas sets itself (each group is a local launch it restarts itself)
_RESERVED = ("env", "max_restarts", "remote", "cluster", "keep_alive", "gpus",
             "num_accelerators")


def _count(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigurationError(f"{name} must be an int >= {least}, got {value!r}")
    return value


def check_options(*, replicas, max_group_restarts, spares, ranks_per_group,
                  gpus_per_replica, launch_options: dict) -> int:
    """Check the run's settings; returns the ranks per replica group.

    ``gpus_per_replica`` is the older name of ``ranks_per_group`` (on GPUs each rank has one);
    giving both with different values is an error rather than a guess."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigurationError(f"replicas must be an int >= 1 or a pair (min, max), got "
                                 f"{replicas!r}")
    _count("max_group_restarts", max_group_restarts, 0)
    _count("spares", spares, 0)
    ranks = _count("ranks_per_group", ranks_per_group, 1)
    gpus = _count("gpus_per_replica", gpus_per_replica, 1)
    if gpus != 1:
        if ranks not in (1, gpus):
            raise ConfigurationError(
                f"ranks_per_group={ranks} and gpus_per_replica={gpus}: give one of them (one "
                "rank per GPU)")
        ranks = gpus
    for reserved in _RESERVED:
        if reserved in launch_options:
            raise ConfigurationError(
                "run_replicas(..., env=...): pass extra_env=" if reserved == "env" else
                f"run_replicas(..., {reserved}=...): not supported here (each replica group is "
                "a local launch that gpulaunch restarts itself; its size is ranks_per_group)")
    return ranks
