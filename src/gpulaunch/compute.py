"""GPU and accelerator types (``GPUType``, ``AcceleratorType``), parsed case-insensitively.

Names follow the seed product (``serverless_gpu.compute`` / ``databricks.air.compute``) so that
``GPUType.H100``, ``"h100"``, ``"H100"``, ``"h100_80gb"`` and ``"GPU_8xH100"`` all keep working,
and add the GPUs people actually have (H200, A100, L4, L40S, B200, ...).
"""

from __future__ import annotations

import enum
import re

from .errors import GPUTypeError


class GPUType(str, enum.Enum):
    """A GPU model. The value is a stable lower-case identifier."""

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
    def parse(cls, value: "GPUType | str") -> "GPUType":
        """Accept an enum member, its name or value (any case), or a known alias."""
        if isinstance(value, GPUType):
            return value
        if isinstance(value, AcceleratorType):
            return value.gpu_type
        if not isinstance(value, str) or not value.strip():
            raise GPUTypeError(f"gpu_type must be a string such as 'H100' or a GPUType, got {value!r}")
        key = value.strip().lower().replace("-", "_")
        if key.startswith("gpu_"):  # an accelerator spelling such as "GPU_8xH100"
            return AcceleratorType.parse(value).gpu_type
        for member in cls:
            if key in (member.name.lower(), member.value):
                return member
        if key in _ALIASES:
            return _ALIASES[key]
        raise GPUTypeError(
            f"Unknown gpu_type {value!r}. Known types: {', '.join(cls.names())} "
            "(case-insensitive; also accepted: accelerator spellings such as 'GPU_8xH100')."
        )


_ALIASES = {
    "a10g": GPUType.A10,
    "a10_24q": GPUType.A10,
    "h100": GPUType.H100,
    "h100_sxm": GPUType.H100,
    "h100_pcie": GPUType.H100,
    "h100_nvl": GPUType.H100,
    "h200_nvl": GPUType.H200,
    "a100_40gb": GPUType.A100,
    "a100_80gb": GPUType.A100,
    "l40": GPUType.L40S,
}

# Substrings of NVML / nvidia-smi device names, checked in order (longest first so "A100" is
# not read as "A10", and "GB200" not as "B200").
_NAME_PATTERNS: list[tuple[str, GPUType]] = [
    (r"\bGB200\b", GPUType.GB200),
    (r"\bB300\b", GPUType.B300),
    (r"\bB200\b", GPUType.B200),
    (r"\bH200\b", GPUType.H200),
    (r"\bH100\b", GPUType.H100),
    (r"\bA100\b", GPUType.A100),
    (r"\bA10G?\b", GPUType.A10),
    (r"\bL40S?\b", GPUType.L40S),
    (r"\bL4\b", GPUType.L4),
    (r"\bV100\b", GPUType.V100),
    (r"\bT4\b", GPUType.T4),
    (r"\bMI300X?\b", GPUType.MI300X),
]


def gpu_type_from_device_name(name: str) -> GPUType | None:
    """Map a device name such as 'NVIDIA H100 80GB HBM3' to a GPUType (None if unknown)."""
    for pattern, member in _NAME_PATTERNS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return member
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
    def parse(cls, value: "AcceleratorType | GPUType | str") -> "AcceleratorType":
        if isinstance(value, AcceleratorType):
            return value
        if isinstance(value, GPUType):
            return cls(1, value)
        if not isinstance(value, str):
            raise GPUTypeError(f"accelerator_type must be a string such as 'GPU_8xH100', got {value!r}")
        m = re.fullmatch(r"\s*gpu_(\d+)x([a-z0-9_\-]+)\s*", value, flags=re.IGNORECASE)
        if m:
            return cls(int(m.group(1)), m.group(2))
        return cls(1, GPUType.parse(value))  # a plain GPU type: one per node unless told otherwise

    @classmethod
    def from_gpu_type(cls, gpu_type: GPUType | str, n: int) -> "AcceleratorType":
        return cls(n, gpu_type)

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

    __str__ = name.fget  # type: ignore[assignment]


for _n, _t in [(1, GPUType.A10), (1, GPUType.H100), (8, GPUType.H100), (8, GPUType.B300),
               (1, GPUType.H200), (8, GPUType.H200), (8, GPUType.A100), (8, GPUType.B200)]:
    setattr(AcceleratorType, f"GPU_{_n}x{_t.name}", AcceleratorType(_n, _t))
