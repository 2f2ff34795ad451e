"""``gpulaunch.compute``: the GPU and accelerator types, named as in ``databricks.air.compute``
(and ``serverless_gpu.compute``), so ``from gpulaunch.compute import GPUType`` ports unchanged.

    GPUType.H100, GPUType.parse("h100"), GPUType.values(), GPUType.names()
    AcceleratorType.GPU_8xH100, AcceleratorType.parse("gpu_8xh100").gpus_per_node  # 8
    AcceleratorType.from_gpu_type("H100", 1)                                      # GPU_1xH100

The types and each model's specs live in ``gpulaunch.hardware.catalog``.
"""

from .hardware.catalog import AcceleratorType, GPUType, gpu_type_from_device_name

__all__ = ["GPUType", "AcceleratorType", "gpu_type_from_device_name"]
