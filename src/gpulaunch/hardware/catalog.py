"""The one GPU catalog: GPU types (``GPUType``, ``AcceleratorType``) and each model's specs.

Names follow the seed product (``databricks.air.compute``) so that ``GPUType.H100``, ``"h100"``,
``"h100_80gb"`` and ``"GPU_8xH100"`` keep working, plus the GPUs people actually have.

Specs: memory is what ``nvidia-smi --query-gpu=memory.total`` reports (MiB), not the marketing GB,
so a plan made with ``--gpu H100`` agrees with one made on the machine; throughput is the dense
bf16 tensor-core datasheet number; bandwidths are achievable NCCL bus bandwidth per GPU (~80% of
the link's unidirectional rate). The planner uses them for *relative* step times.

One matcher (``model_for``) reads both a user's spelling and a driver's device name.
"""

from __future__ import annotations

import dataclasses
import enum
import re

from ..errors import GPUTypeError

MiB = 1 << 20


class GPUType(str, enum.Enum):
    """A GPU model family. The value is a stable lower-case identifier (the seed's values)."""

    B300 = "b300"
    B200 = "b200"
    GB200 = "gb200"
    H200 = "h200"
    H100 = "h100_80gb"
    A100 = "a100"
    A10 = "a10"
    L40S = "l40s"
    L4 = "l4"
    V100 = "v100"
    T4 = "t4"
    MI300X = "mi300x"

    @classmethod
    def values(cls) -> list[str]:
        return [m.value for m in cls]

    @classmethod
    def names(cls) -> list[str]:
        return [m.name for m in cls]

    @classmethod
    def parse(cls, value) -> "GPUType":
        """Accept a member, its name or value (any case), a known alias or an accelerator
        spelling ("GPU_8xH100")."""
        if isinstance(value, GPUType):
            return value
        if isinstance(value, AcceleratorType):
            return value.gpu_type
        if not isinstance(value, str) or not value.strip():
            raise GPUTypeError(f"gpu_type must be a string such as 'H100' or a GPUType, "
                               f"got {value!r}")
        key = value.strip().lower().replace("-", "_")
        if key.startswith("gpu_"):
            return AcceleratorType.parse(value).gpu_type
        for member in cls:
            if key in (member.name.lower(), member.value):
                return member
        if key in _ALIASES:
            return _ALIASES[key]
        raise GPUTypeError(
            f"Unknown gpu_type {value!r}. Known types: {', '.join(cls.names())} "
            "(case-insensitive; also accepted: accelerator spellings such as 'GPU_8xH100').")


_ALIASES = {
    "a10g": GPUType.A10, "a10_24q": GPUType.A10, "h100": GPUType.H100,
    "h100_sxm": GPUType.H100, "h100_pcie": GPUType.H100, "h100_nvl": GPUType.H100,
    "h200_nvl": GPUType.H200, "a100_40gb": GPUType.A100, "a100_80gb": GPUType.A100,
    "l40": GPUType.L40S,
}


@dataclasses.dataclass(frozen=True)
class GPUModel:
    """One GPU model and the numbers the planner and the benchmarks need."""

    name: str
    gpu_type: GPUType | None
    memory_bytes: int
    bf16_tflops: float           # dense, datasheet
    intra_node_gbps: float       # GB/s per GPU, NCCL bus bandwidth inside a node
    inter_node_gbps: float       # GB/s per GPU across nodes (typical fabric for this class)
    host_link_gbps: float = 25.0  # host<->device (PCIe achievable), for CPU offload
    fp8: bool = False            # tensor cores with FP8 (compute capability >= 8.9)
    pattern: str = ""            # regex over driver device names

    def with_memory(self, memory_bytes: int) -> "GPUModel":
        return dataclasses.replace(self, memory_bytes=memory_bytes)


_T = GPUType
# Ordered: the first pattern that matches a device name wins (GB200 before B200, A100 before A10).
MODELS: dict[str, GPUModel] = {m.name: m for m in [
    GPUModel("GB200", _T.GB200, 189471 * MiB, 2500.0, 720.0, 45.0, 50.0, True, r"\bGB200\b"),
    GPUModel("B300", _T.B300, 275040 * MiB, 2500.0, 720.0, 45.0, 50.0, True, r"\bB300\b"),
    GPUModel("B200", _T.B200, 183359 * MiB, 2250.0, 720.0, 45.0, 50.0, True, r"\bB200\b"),
    GPUModel("H200", _T.H200, 143771 * MiB, 989.0, 360.0, 45.0, 50.0, True, r"\bH200\b"),
    GPUModel("H100", _T.H100, 81559 * MiB, 989.0, 360.0, 45.0, 50.0, True, r"\bH100\b"),
    GPUModel("A100-40GB", _T.A100, 40960 * MiB, 312.0, 240.0, 22.0, 25.0, False,
             r"\bA100\b.*\b40\s?GB\b"),
    GPUModel("A100-80GB", _T.A100, 81920 * MiB, 312.0, 240.0, 22.0, 25.0, False, r"\bA100\b"),
    GPUModel("A10G", _T.A10, 23028 * MiB, 70.0, 20.0, 3.0, 25.0, False, r"\bA10G\b"),
    GPUModel("A10", _T.A10, 23028 * MiB, 125.0, 20.0, 3.0, 25.0, False, r"\bA10\b"),
    GPUModel("L40S", _T.L40S, 46068 * MiB, 362.0, 20.0, 10.0, 25.0, True, r"\bL40S?\b"),
    GPUModel("L4", _T.L4, 23034 * MiB, 121.0, 20.0, 3.0, 25.0, True, r"\bL4\b"),
    GPUModel("RTX4090", None, 24564 * MiB, 165.0, 20.0, 3.0, 25.0, True, r"\b4090\b"),
    GPUModel("V100", _T.V100, 32768 * MiB, 125.0, 130.0, 12.0, 12.0, False, r"\bV100\b"),
    GPUModel("T4", _T.T4, 15360 * MiB, 65.0, 10.0, 3.0, 12.0, False, r"\bT4\b"),  # fp16 number
    GPUModel("MI300X", _T.MI300X, 196592 * MiB, 1307.0, 360.0, 45.0, 50.0, True,
             r"\bMI300X?\b"),
]}

# The model a bare type name means (``--gpu A100`` -> the 80 GB part).
_DEFAULT_MODEL = {_T.A100: "A100-80GB", _T.A10: "A10"}


def _key(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().upper().replace("NVIDIA", "").strip())


def model_for(name: str) -> GPUModel:
    """A model from a user's spelling ("H100", "a100-40gb", "h100_80gb", "GPU_8xH100") or a
    driver's device name ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB")."""
    key = _key(name)
    for m in MODELS.values():
        if key == m.name:
            return m
    for m in MODELS.values():
        if m.pattern and re.search(m.pattern, name, flags=re.IGNORECASE):
            return m
    try:
        t = GPUType.parse(name)
    except GPUTypeError:
        t = None
    if t is not None:
        default = _DEFAULT_MODEL.get(t)
        for m in MODELS.values():
            if m.name == default or (default is None and m.gpu_type is t):
                return m
    raise GPUTypeError(f"unknown GPU {name!r}; use one of {', '.join(MODELS)} "
                       "(or pass gpu_memory_bytes=)")


def gpu_type_from_device_name(name: str) -> GPUType | None:
    """Map a device name such as 'NVIDIA H100 80GB HBM3' to a GPUType (None if unknown)."""
    for m in MODELS.values():
        if m.pattern and re.search(m.pattern, name, flags=re.IGNORECASE):
            return m.gpu_type
    return None


class AcceleratorType:
    """An accelerator shape ``GPU_<n>x<TYPE>`` (the seed's newer spelling), e.g. ``GPU_8xH100``.

    ``AcceleratorType.GPU_8xH100`` and ``AcceleratorType.parse("gpu_8xh100")`` are equal;
    ``.gpu_type`` is the GPUType and ``.gpus_per_node`` the count.
    """

    __slots__ = ("gpus_per_node", "gpu_type")

    def __init__(self, gpus_per_node: int, gpu_type: GPUType | str):
        if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise GPUTypeError(f"gpus_per_node must be a positive int, got {gpus_per_node!r}")
        self.gpus_per_node = gpus_per_node
        self.gpu_type = GPUType.parse(gpu_type)

    @property
    def name(self) -> str:
        return f"GPU_{self.gpus_per_node}x{self.gpu_type.name}"

    value = name

    @classmethod
    def parse(cls, value) -> "AcceleratorType":
        if isinstance(value, AcceleratorType):
            return value
        if isinstance(value, GPUType):
            return cls(1, value)
        if not isinstance(value, str):
            raise GPUTypeError(f"accelerator_type must be a string such as 'GPU_8xH100', "
                               f"got {value!r}")
        m = re.fullmatch(r"\s*gpu_(\d+)x([a-z0-9_\-]+)\s*", value, flags=re.IGNORECASE)
        if m:
            return cls(int(m.group(1)), m.group(2))
        return cls(1, GPUType.parse(value))

    @classmethod
    def from_gpu_type(cls, gpu_type: GPUType | str, n: int) -> "AcceleratorType":
        """The seed's mapping: H100 with n == 1 is GPU_1xH100, otherwise 8 per node for the
        8-GPU types; any other type keeps n per node."""
        t = GPUType.parse(gpu_type)
        if t in (GPUType.H100, GPUType.B300, GPUType.H200, GPUType.B200) and n != 1:
            return cls(8, t)
        return cls(n, t)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            try:
                other = AcceleratorType.parse(other)
            except GPUTypeError:
                return False
        return (isinstance(other, AcceleratorType) and other.gpus_per_node == self.gpus_per_node
                and other.gpu_type == self.gpu_type)

    def __hash__(self) -> int:
        return hash((self.gpus_per_node, self.gpu_type))

    def __repr__(self) -> str:
        return f"AcceleratorType.{self.name}"

    def __str__(self) -> str:
        return self.name


for _n, _t in [(1, GPUType.A10), (1, GPUType.H100), (8, GPUType.H100), (8, GPUType.B300),
               (1, GPUType.H200), (8, GPUType.H200), (8, GPUType.A100), (8, GPUType.B200)]:
    setattr(AcceleratorType, f"GPU_{_n}x{_t.name}", AcceleratorType(_n, _t))
