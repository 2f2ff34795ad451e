"""gpulaunch: run a Python training function on every GPU of a machine (or CPU workers, or a
Ray cluster) with one decorator.

    from gpulaunch import distributed, runtime as rt

    @distributed(gpus=8)
    def train(lr):
        device = rt.init()
        ...
        return rt.get_global_rank()

    train.distributed(lr=3e-4)     # -> [0, 1, ..., 7]
"""

from . import runtime
from .api import DistributedFunction, RunHandle, distributed
from .backends.ray.cluster import RayCluster   # imports no ray until used
from .compute import AcceleratorType, GPUType
from .errors import (ArgumentError, ConfigurationError, GpulaunchError, GPUTypeError,
                     GPUValidationError, HangError, LaunchError, LocalExecutionTimeoutError,
                     NodeLostError, RemoteError, RunCancelledError, RunError, RunTimeoutError,
                     RuntimeConfigurationError, SerializationError, UserError, WorkerCrashError)

__version__ = "0.1.0"

__all__ = [
    "distributed", "DistributedFunction", "RunHandle", "runtime", "GPUType", "AcceleratorType",
    "GpulaunchError", "UserError", "ConfigurationError", "RuntimeConfigurationError",
    "GPUValidationError", "GPUTypeError", "ArgumentError", "SerializationError", "RunError",
    "WorkerCrashError", "RemoteError", "RunTimeoutError", "LocalExecutionTimeoutError",
    "HangError", "RunCancelledError", "LaunchError", "NodeLostError", "RayCluster",
]
