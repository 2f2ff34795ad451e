"""Bytes that autograd keeps for backward, per token, for one transformer block and around it.

Counted from the Hugging Face Llama implementation with SDPA/flash attention (no S x S matrix), tensor
by tensor; bench/planner_calibrate.py checks every formula here against the bytes actually saved
(torch.autograd.graph.saved_tensors_hooks on CPU: device independent). Notation per token:
h hidden, q = heads*head_dim, kv = kv_heads*head_dim, i intermediate, c compute-dtype bytes.

Full fine-tune, model stored in the compute dtype ("pure", also FSDP2/DeepSpeed mixed precision):
  RMSNorm     x upcast to fp32 (4h) + normalized (c*h, kept by the weight multiply) + output (c*h,
              kept by the next matmul)                                     -> 2 norms: 2*(4+2c)*h
  attention   rotated q, rotated k, v, output (kept by SDPA and o_proj) + fp32 log-sum-exp per head
                                                                           -> c*(2q+2kv) + 4*heads
  SwiGLU MLP  gate out, SiLU out, up out, their product                   -> 4c*i
torch.autocast over fp32 parameters (DDP "bf16"): the residual stream stays fp32 and every matmul
keeps its own bf16 cast of its input, so norms keep 8h each plus 2h per consuming matmul, and SDPA
keeps a bf16 cast of the fp32 rotated q.
LoRA: frozen matmuls keep nothing for their weights, so norms keep only the fp32 upcast and the MLP
product is not kept by down_proj; each adapter keeps its input (an fp32 copy when adapters are fp32,
peft's default) and its rank-r hidden.
"""
from __future__ import annotations

from dataclasses import dataclass

from .shapes import ModelShape
from .training_setup import TrainingSetup

# How the model's tensors are laid out while computing (chosen per technique by memory.py).
PURE = "pure"            # parameters already in the compute dtype
AUTOCAST = "autocast"    # fp32 parameters under torch.autocast


@dataclass(frozen=True)
class ActivationProfile:
    per_layer: int            # bytes kept by one block (no checkpointing)
    checkpoint: int           # bytes kept per block when the block is checkpointed (its input)
    outside_layers: int       # final norm, embedding indices, rotary tables
    layer_backward_transient: int   # gradients alive inside one block's backward
    loss_forward: int         # logits and fp32 log-softmax while the loss is computed
    loss_backward: int        # log-softmax output + its gradient in and out, start of backward
    num_layers: int
    checkpointing: bool

    @property
    def saved(self) -> int:
        """Kept across the whole forward->backward gap."""
        per = self.checkpoint if self.checkpointing else self.per_layer
        return self.num_layers * per + self.outside_layers

    @property
    def recompute(self) -> int:
        """Extra bytes while one checkpointed block is recomputed during backward."""
        return self.per_layer if self.checkpointing else 0


def _adapters(shape: ModelShape, setup: TrainingSetup, adapter_bytes: int) -> int:
    r = setup.lora_rank or 0
    c = setup.compute_bytes
    if adapter_bytes != c:   # fp32 adapters on a bf16 base: one fp32 copy of the input per adapter
        return sum(adapter_bytes * din + adapter_bytes * r for _, din, _ in shape.linear_shapes())
    # Same dtype: adapters keep the base matmul's input itself, shared by q/k/v and by gate/up; the
    # attention output is already kept by SDPA.
    kept_inputs = {"q_proj": shape.hidden_size, "gate_proj": shape.hidden_size, "fc1": shape.hidden_size,
                   "down_proj": shape.intermediate_size, "fc2": shape.intermediate_size}
    names = {n for n, _, _ in shape.linear_shapes()}
    return sum(c * d for n, d in kept_inputs.items() if n in names) + c * r * len(names)


def _block(shape: ModelShape, setup: TrainingSetup, mode: str, adapter_bytes: int) -> int:
    h, q, kv, i = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    c = setup.compute_bytes
    lse = 4 * shape.num_heads
    n_mlp_in = 2 if shape.mlp == "swiglu" else 1
    if shape.family == "encoder":
        # LayerNorm keeps its input and normalized output; q, k, v, attention output; GELU MLP keeps
        # fc1 output and GELU output. (Approximate: encoders are small; dropout masks ignored.)
        return 2 * 2 * c * h + c * 4 * q + lse + 2 * c * i
    if setup.lora:
        norms = 2 * 4 * h
        attn = c * (2 * q + 2 * kv) + lse
        mlp = (3 if shape.mlp == "swiglu" else 1) * c * i
        block = norms + attn + mlp + _adapters(shape, setup, adapter_bytes)
    elif mode == AUTOCAST:
        norms = 2 * 8 * h + 2 * h * (3 + n_mlp_in)
        attn = 2 * (2 * q + 2 * kv) + lse
        mlp = (4 if shape.mlp == "swiglu" else 2) * 2 * i
        block = norms + attn + mlp
    else:
        norms = 2 * (4 + 2 * c) * h
        attn = c * (2 * q + 2 * kv) + lse
        mlp = (4 if shape.mlp == "swiglu" else 2) * c * i
        block = norms + attn + mlp
    if shape.qk_norm:
        block += (4 + c) * (q + kv)
    if shape.is_moe:
        # Each token visits k experts: a gathered copy of its input and the expert's SwiGLU
        # intermediates (gate_up output, clamped/activated halves, product), plus fp32 router logits.
        # Not yet checked against a measured MoE; treat as approximate.
        block -= mlp
        block += shape.experts_per_token * (c * h + 6 * c * i) + 8 * shape.num_experts
    return block


def profile(shape: ModelShape, setup: TrainingSetup, mode: str, adapter_bytes: int) -> ActivationProfile:
    """Activation bytes for one micro-batch. ``adapter_bytes``: 4 (fp32 LoRA adapters) or the compute
    dtype's size; ignored without LoRA."""
    T, c = setup.tokens, setup.compute_bytes
    if shape.family == "generic":
        return ActivationProfile(0, 0, 0, 0, 0, 0, 0, setup.activation_checkpointing)
    h, i, V = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    block = _block(shape, setup, mode, adapter_bytes) * T
    resid = 4 if (mode == AUTOCAST and not setup.lora) else c
    checkpoint = resid * h * T
    final_norm = {True: 4 * h, False: (8 * h + 2 * h) if mode == AUTOCAST else (4 + 2 * c) * h}[setup.lora]
    rotary = 2 * setup.seq_len * shape.head_dim * (4 if mode == AUTOCAST else c)
    outside = final_norm * T + 8 * T + rotary
    # Inside one block's backward: the gradient of the MLP intermediates (about two i-wide tensors
    # at a time) and of the block input/output.
    transient = (2 * c * i + 2 * resid * h) * T
    if shape.family == "encoder" or shape.num_classes:
        loss_f = loss_b = 4 * T * max(shape.num_classes, 1) * 3
    else:
        # HF ForCausalLMLoss: logits (compute dtype) -> .float() copy -> log_softmax (kept) -> nll.
        # Forward peak: logits + fp32 copy + log_softmax. Backward start: log_softmax output, the
        # gradient arriving from nll_loss and the gradient it produces, all fp32 (logits themselves
        # are freed by then unless the caller keeps the model output alive).
        upcast = 4 if c != 4 else 0
        loss_f = (c + upcast + 4) * T * V
        loss_b = 12 * T * V
    return ActivationProfile(per_layer=block, checkpoint=checkpoint, outside_layers=outside,
                             layer_backward_transient=transient, loss_forward=loss_f, loss_backward=loss_b,
                             num_layers=shape.num_layers, checkpointing=setup.activation_checkpointing)
