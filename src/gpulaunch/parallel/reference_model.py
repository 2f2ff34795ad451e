"""A small Llama-shaped decoder in plain PyTorch, built from a config.

Used by the tests, the benchmarks and the docs of :mod:`gpulaunch.parallel` so that
they need no model hub and no ``transformers``. It is a faithful-enough Llama:
RMSNorm, rotary embeddings, grouped-query attention through SDPA, SwiGLU MLP,
optional tied embeddings. Random init only.

Written to be at least as fast as ``transformers``' ``LlamaForCausalLM`` in eager mode:

* RMSNorm is ``F.rms_norm`` (one fused kernel on CUDA instead of six element-wise ones) and,
  under autocast, hands its consumers the bf16 they would each cast it to;
* grouped-query attention passes ``enable_gqa=True`` to SDPA instead of copying each K/V head
  ``n_heads / n_kv_heads`` times (and summing the copies' gradients back in backward);
* the rotary tables are cast once per forward to the dtype the attention computes in (bf16
  under autocast), so RoPE does not promote q and k to fp32 and back;
* ``LlamaConfig(chunked_loss=N)`` computes the head and the loss N tokens at a time without
  materialising the logits (:func:`gpulaunch.parallel.chunked_cross_entropy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .loss import chunked_cross_entropy

__all__ = ["LLAMA_1B", "TINY", "Block", "Llama", "LlamaConfig"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # > 0: fused head + cross-entropy over chunks of this many tokens (no full logits); 0: plain
    chunked_loss: int = 0

    def shape(self, name: str = "reference-llama"):
        """This architecture as the planner's ModelShape: one description of the dimensions, so that
        the planner's parameter and memory arithmetic is the one the tests and benchmarks check."""
        from ..planner.shapes import ModelShape
        return ModelShape(name, vocab_size=self.vocab_size, hidden_size=self.dim, num_layers=self.n_layers,
                          num_heads=self.n_heads, num_kv_heads=self.n_kv_heads, intermediate_size=self.ffn_dim,
                          tie_embeddings=self.tie_embeddings)

    def num_params(self) -> int:
        return self.shape().total_params


# Llama-3.2-1B's shape: 1.24 B parameters with tied embeddings.
LLAMA_1B = LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                       ffn_dim=8192, max_seq_len=2048, rope_theta=500000.0, tie_embeddings=True)
TINY = LlamaConfig()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalises in fp32 whatever x's dtype (as HF's LlamaRMSNorm)
        out = F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            # Under autocast the residual stream is fp32 and every linear that reads this output
            # would cast it to bf16 again (q, k and v: three casts, and three fp32 gradients to
            # add in backward); casting once here gives the same numbers for a third of the work.
            out = out.to(torch.get_autocast_dtype(dev))
        return out


def _rope(x, cos, sin):
    # x: (B, H, T, D), cos/sin: (T, D/2) in x's dtype; rotate the two halves
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv = c.n_heads, c.n_kv_heads
        self.head_dim = c.dim // c.n_heads
        self.wq = nn.Linear(c.dim, c.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * self.head_dim, c.dim, bias=False)
        self.expand_kv = False   # set by prepare() under context parallelism

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        # heads as -1: under tensor parallelism each rank holds n_heads / tensor of them
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        gqa = q.shape[1] != k.shape[1]
        if gqa and self.expand_kv:
            # context parallel's ring attention calls the SDPA kernels itself, without enable_gqa
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            gqa = False
        # SDPA reads each K/V head for its n_heads/n_kv query heads itself (no copies)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(c.dim, c.norm_eps)
        self.attn = Attention(c)
        self.mlp_norm = RMSNorm(c.dim, c.norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """``Llama(config)(tokens) -> logits``; ``model(tokens, targets)`` -> mean cross-entropy loss."""

    def __init__(self, config: LlamaConfig = TINY):
        super().__init__()
        self.config = c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self):
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=std / math.sqrt(2 * self.config.n_layers) if name.endswith(("wo.weight", "w2.weight")) else std)
            else:
                nn.init.ones_(p)

    def _rope_tables(self, T: int, device, positions=None):
        c = self.config
        hd = c.dim // c.n_heads
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        t = torch.arange(T, device=device, dtype=torch.float32) if positions is None else positions.float()
        freqs = torch.outer(t, inv)
        return freqs.cos(), freqs.sin()   # fp32; each attention casts them to its q's dtype

    def forward(self, tokens, targets=None, positions=None):
        """``positions`` (1-D, one per token): where each token sits in the sequence, when it is
        not ``0..T-1``: under context parallelism each rank holds a reordered share of it."""
        x = self.tok_emb(tokens)
        cos, sin = self._rope_tables(tokens.shape[1], tokens.device, positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(x, targets)

    def head(self, x, targets=None):
        """Final norm, output head and loss. A method of its own so that, when ``forward`` runs
        eagerly around compiled blocks (FSDP2's hooks break the graph at every block), dynamo
        still compiles this part, the costliest element-wise work at a large vocabulary."""
        h = self.norm(x)
        if targets is not None and self.config.chunked_loss:
            return chunked_cross_entropy(h, self.lm_head.weight, targets, chunk_tokens=self.config.chunked_loss)
        logits = self.lm_head(h)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
