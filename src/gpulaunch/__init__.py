"""gpulaunch: run a Python training function on every GPU of a machine (or CPU workers, or a
Ray cluster) with one decorator.

    from gpulaunch import distributed, runtime as rt

    @distributed(gpus=8)
    def train(lr):
        device = rt.init()
        ...
        return rt.get_global_rank()

    train.distributed(lr=3e-4)     # -> [0, 1, ..., 7]

A notebook written for ``databricks.air`` (or ``serverless_gpu``) ports by changing the import
line: ``distributed``, ``ray_launch``, ``ray_init``, ``runtime``, ``compute`` and the error
names are here under the same names.
"""

from . import compute, runtime
from .api import (
    DistributedFunction,
    RayCluster,
    RunHandle,
    distributed,
    ray_init,
    ray_launch,
    shutdown,
)
from .compute import AcceleratorType, GPUType
from .errors import (
                     ArgumentError,
                     ConfigurationError,
                     GpulaunchError,
                     GPUTypeError,
                     GPUValidationError,
                     HangError,
                     LaunchError,
                     LocalExecutionTimeoutError,
                     NodeLostError,
                     PreemptedError,
                     RemoteError,
                     RunCancelledError,
                     RunError,
                     RuntimeConfigurationError,
                     RunTimeoutError,
                     SerializationError,
                     StateDroppedError,
                     UserError,
                     WorkerCrashError,
)
from .options import LaunchOptions

__version__ = "0.2.0"

__all__ = [
    "distributed", "ray_launch", "ray_init", "DistributedFunction", "RunHandle", "runtime",
    "compute", "GPUType", "AcceleratorType", "LaunchOptions", "RayCluster",
    "GpulaunchError", "UserError", "ConfigurationError", "RuntimeConfigurationError",
    "GPUValidationError", "GPUTypeError", "ArgumentError", "SerializationError", "RunError",
    "WorkerCrashError", "RemoteError", "RunTimeoutError", "LocalExecutionTimeoutError",
    "HangError", "RunCancelledError", "LaunchError", "NodeLostError", "StateDroppedError",
    "PreemptedError", "shutdown",
]
