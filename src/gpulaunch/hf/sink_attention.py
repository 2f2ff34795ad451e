"""Attention with per-head sinks (gpt-oss) through PyTorch's fused SDPA kernels.

gpt-oss adds one learned logit per head, the "sink", to every softmax row and drops it after the
softmax: ``p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))``. transformers 5.24 has no SDPA
path for it (``GptOssPreTrainedModel._supports_sdpa = False``): without FlashAttention-3 kernels
from the Hub (not reachable from an offline GPU host) a model runs the eager attention, which
writes and re-reads the full ``heads x T x T`` score matrix several times per layer (at 2048
tokens and 64 heads, 0.5 GB per tensor) and keeps it for backward. ``flex_attention`` supports
sinks, on CUDA only (transformers refuses it on CPU, and flex's backward has no CPU kernel).

The sink as one more key, exactly: SDPA computes ``scale * q.k``. Give every query one extra
feature ``sink_h / scale`` and every real key a 0 there, and append one key that is 0 everywhere
but 1 in that feature, with a value of zeros. Its score is ``scale * sink_h / scale = sink_h`` for
every query of head h, it adds ``exp(sink_h)`` to each row's denominator and nothing to the
output: the gpt-oss formula, forward and backward (the sink's gradient flows through the extra
query feature). The head dim is padded to a multiple of 8 (64 -> 72) so the fused kernels take
it; the mask gets one always-visible column, so causal and sliding-window layers keep their
masks. With a mask, SDPA on CUDA runs the memory-efficient (or cuDNN) kernel, not the math one:
key/value heads are repeated to the query heads first, as transformers does for masked SDPA.

    from gpulaunch.hf.sink_attention import register, NAME
    register()                                   # once per process, before building the model
    model = AutoModelForCausalLM.from_config(config, attn_implementation=NAME)

``gpulaunch.hf.speed_settings`` chooses it for models with attention sinks (and registers it).
"""

from __future__ import annotations

NAME = "gpulaunch_sinks"   # no "sdpa"/"flash"/"flex" in it: transformers matches those substrings

__all__ = ["NAME", "register", "sdpa_sinks_attention_forward"]


def _repeat_kv(x, n_rep: int):
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _causal_mask(q_len: int, kv_len: int, device):
    """Bottom-right aligned causal mask (the last query sees every key), True = attend."""
    import torch
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


def sdpa_sinks_attention_forward(module, query, key, value, attention_mask, scaling=None,
                                 dropout: float = 0.0, s_aux=None, **kwargs):
    """transformers' attention interface: ``query`` (B, H, T, d), ``key``/``value`` (B, Hkv, S,
    d), ``attention_mask`` a boolean (B, 1, T, S) mask (True = attend) or None (causal), ``s_aux``
    the (H,) sink logits. Returns ((B, T, H, d), None)."""
    import torch
    import torch.nn.functional as F
    b, h, t, d = query.shape
    s = key.shape[-2]
    scale = scaling if scaling is not None else d ** -0.5
    n_rep = h // key.shape[1]
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    if attention_mask is None:
        attention_mask = _causal_mask(t, s, query.device)[None, None]
    elif attention_mask.dtype != torch.bool:      # an additive float mask: 0 = attend
        attention_mask = attention_mask == 0
    attention_mask = attention_mask[..., :s]
    if s_aux is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             dropout_p=dropout, scale=scale)
        return out.transpose(1, 2).contiguous(), None
    extra = 8 - d % 8                       # the sink feature + zeros up to a multiple of 8
    sink = (s_aux.to(query.dtype) / scale).view(1, h, 1, 1).expand(b, h, t, 1)
    q = torch.cat([query, sink, query.new_zeros(b, h, t, extra - 1)], dim=-1)
    k = torch.cat([key, key.new_zeros(b, h, s, extra)], dim=-1)
    sink_key = key.new_zeros(b, h, 1, d + extra)
    sink_key[..., d] = 1
    k = torch.cat([k, sink_key], dim=-2)
    v = torch.cat([value, value.new_zeros(b, h, s, extra)], dim=-1)
    v = torch.cat([v, value.new_zeros(b, h, 1, d + extra)], dim=-2)
    mask = torch.cat([attention_mask.expand(b, -1, t, s),
                      attention_mask.new_ones(b, attention_mask.shape[1], t, 1)], dim=-1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out[..., :d].transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention (and its mask: SDPA's boolean one) with transformers under
    ``NAME``; idempotent. Returns ``NAME``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    AttentionInterface.register(NAME, sdpa_sinks_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME
