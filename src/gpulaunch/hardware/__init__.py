"""What GPUs exist (``catalog``), which this host has (``host.detect``), and what they are doing
(``nvml``). Nothing here initialises CUDA."""

from .catalog import (
           MODELS,
           AcceleratorType,
           GPUModel,
           GPUType,
           gpu_type_from_device_name,
           model_for,
)
from .host import GPUInfo, HostInfo, detect, max_cpu_workers

__all__ = ["MODELS", "AcceleratorType", "GPUModel", "GPUType", "gpu_type_from_device_name",
           "model_for", "GPUInfo", "HostInfo", "detect", "max_cpu_workers"]
