"""ModelShape: the few numbers of an architecture that memory and time depend on.

Why a shape and not the model: the planner must answer before anything is loaded (a config file, a
name from the catalog, a module on the meta device), and every formula below needs only these
dimensions. Parameter counts are derived from the dimensions so that a catalog entry cannot
silently disagree with itself; a shape taken from a real module can override them with exact counts.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

# Families with a per-layer activation model. "generic" means: parameters known, activations not.
FAMILIES = ("decoder", "encoder", "generic")


@dataclass(frozen=True)
class ModelShape:
    name: str
    family: str = "decoder"
    vocab_size: int = 0
    hidden_size: int = 0
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    tie_embeddings: bool = False
    mlp: str = "swiglu"            # "swiglu" (gate, up, down) or "gelu" (fc1, fc2)
    norm: str = "rmsnorm"          # "rmsnorm" or "layernorm" (with bias)
    attention_bias: bool = False   # q/k/v/o biases (gpt-oss, BERT-style encoders)
    mlp_bias: bool = False
    qk_norm: bool = False          # OLMo 2/3: RMSNorm over the full q and k projections
    attention_sinks: bool = False  # gpt-oss: one learned logit per head
    post_norms: bool = False       # OLMo 2/3 put norms after attention/MLP (still two per layer)
    num_experts: int = 0           # 0: dense MLP
    experts_per_token: int = 0
    max_position_embeddings: int = 0   # > 0 only for learned absolute positions (encoders)
    num_classes: int = 0           # classifier head instead of an LM head (encoders)
    # Exact counts from a real module override the derived ones (None: derive).
    params_override: int | None = None
    trainable_override: int | None = None
    largest_layer_override: int | None = None
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"ModelShape.family must be one of {FAMILIES}, got {self.family!r}")
        if self.family != "generic":
            for k in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
                if getattr(self, k) <= 0:
                    raise ValueError(f"ModelShape {self.name!r}: {k} must be > 0 for family {self.family!r}")
            if self.num_kv_heads <= 0:
                object.__setattr__(self, "num_kv_heads", self.num_heads)
            if self.head_dim <= 0:
                object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"ModelShape {self.name!r}: num_heads ({self.num_heads}) must be a multiple "
                                 f"of num_kv_heads ({self.num_kv_heads})")
        elif self.params_override is None:
            raise ValueError(f"ModelShape {self.name!r}: a generic shape needs params_override")

    # -- dimensions ---------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of the linear layers in one block, the ones LoRA "all-linear" adapts.

        MoE expert weights are batched 3-D tensors in HF (not nn.Linear), so LoRA does not reach them;
        only attention projections are listed for MoE models."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        out = [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h)]
        if self.is_moe:
            return out
        if self.mlp == "swiglu":
            out += [("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]
        else:
            out += [("fc1", h, i), ("fc2", i, h)]
        return out

    # -- parameter counts ---------------------------------------------------------------------
    def _norm_params(self) -> int:
        return self.hidden_size * (2 if self.norm == "layernorm" else 1)

    def attention_params(self) -> int:
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        n = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            n += q + 2 * kv + h
        if self.qk_norm:
            n += q + kv
        if self.attention_sinks:
            n += self.num_heads
        return n

    def expert_params(self) -> int:
        """One MLP (one expert for MoE)."""
        h, i = self.hidden_size, self.intermediate_size
        if self.mlp == "swiglu":
            return 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        return 2 * h * i + ((i + h) if self.mlp_bias else 0)

    def mlp_params(self) -> int:
        if not self.is_moe:
            return self.expert_params()
        router = self.hidden_size * self.num_experts + self.num_experts
        return self.num_experts * self.expert_params() + router

    def layer_params(self) -> int:
        return self.attention_params() + self.mlp_params() + 2 * self._norm_params()

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size + self.max_position_embeddings * self.hidden_size

    def head_params(self) -> int:
        """Output head: untied LM head, or a classifier; 0 when tied to the embedding."""
        if self.num_classes:
            return self.hidden_size * self.num_classes + self.num_classes
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        if self.params_override is not None:
            return self.params_override
        return (self.embedding_params() + self.num_layers * self.layer_params()
                + self._norm_params() + self.head_params())

    @property
    def active_params(self) -> int:
        """Parameters that do matmul work per token (the 6·N·T FLOP rule): the embedding lookup is free,
        the LM head is not; an MoE layer runs only experts_per_token experts."""
        if self.family == "generic":
            return self.total_params
        per_layer = self.layer_params()
        if self.is_moe:
            per_layer -= (self.num_experts - self.experts_per_token) * self.expert_params()
        head = self.head_params() or (self.vocab_size * self.hidden_size)
        return self.num_layers * per_layer + head

    @property
    def largest_layer_params(self) -> int:
        """Largest unit FSDP/ZeRO-3 must gather at once: a block, or the embedding/head."""
        if self.largest_layer_override is not None:
            return self.largest_layer_override
        if self.family == "generic":
            return self.total_params
        return max(self.layer_params(), self.embedding_params(), self.head_params())

    def lora_params(self, rank: int) -> int:
        return self.num_layers * sum(rank * (i + o) for _, i, o in self.linear_shapes())

    def with_exact_counts(self, total: int, trainable: int | None = None) -> "ModelShape":
        return replace(self, params_override=total, trainable_override=trainable)
