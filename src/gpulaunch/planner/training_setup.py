"""TrainingSetup: everything about the run other than the model, validated once.

Precision names what is stored and what is computed, because the byte counts follow from that:
  "bf16"       bf16 compute, fp32 master weights and fp32 optimizer state (standard mixed precision).
               How each technique does it: DDP runs torch.autocast over fp32 parameters; FSDP2 keeps
               fp32 shards and all-gathers bf16 (MixedPrecisionPolicy(param_dtype=bf16,
               reduce_dtype=fp32)); DeepSpeed keeps bf16 parameters and an fp32 master copy.
  "bf16-pure"  the model itself is bf16, so are gradients and optimizer state (no master copy).
               DeepSpeed has no such mode, so ZeRO falls back to its "bf16".
  "fp16"       as "bf16" (same sizes); "fp32": everything fp32.
With LoRA the frozen base is stored in the compute dtype and the adapters in fp32 (peft's default
autocast_adapter_dtype=True), except under FSDP2/ZeRO which cast adapters to bf16 with the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("bf16", "bf16-pure", "fp16", "fp32")
OPTIMIZERS = {  # bytes of state per trainable parameter, in the state dtype's element count
    "adamw": 2, "adam": 2, "sgd": 1, "sgd-nomomentum": 0, "adafactor": 0, "lion": 1,
}
# The extra full-size temporary torch's default (foreach) AdamW allocates in step(); fused has none.
OPTIMIZER_IMPLS = ("foreach", "fused")


@dataclass(frozen=True)
class TrainingSetup:
    micro_batch_size: int = 1
    seq_len: int = 2048
    precision: str = "bf16"
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"
    lora_rank: int | None = None
    activation_checkpointing: bool = False

    def __post_init__(self):
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"optimizer_impl must be one of {OPTIMIZER_IMPLS}, got {self.optimizer_impl!r}")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(f"lora_rank must be a positive integer or None, got {self.lora_rank}")

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def lora(self) -> bool:
        return self.lora_rank is not None
