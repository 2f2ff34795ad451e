"""Cross-entropy of a language-model head without materialising the logits.

With a 128k vocabulary the logits of one micro-batch of 4 x 2048 tokens are 2 GiB in bf16, and
the usual ``F.cross_entropy(logits.float(), ...)`` adds 4 GiB of fp32 copies, a log-softmax of
the same size and its gradient. :func:`chunked_cross_entropy` takes the hidden states and the
head's weight instead and walks the tokens in chunks: per chunk it computes the logits, their
log-sum-exp in fp32, the loss, and, since the loss is the end of the graph, the gradients of
the hidden states and of the weight right away. Only one chunk's logits ever exist; backward
merely scales the gradients kept from forward, so no matmul is recomputed (three matmuls in
all, as with the plain loss).

Exactness: the same operations in the same precision as the plain loss, except that the
weight's gradient is summed over chunks (fp32 accumulation of per-chunk matmuls). In fp32 it
matches the plain loss to rounding; in bf16, within bf16's tolerance.
"""

from __future__ import annotations

import torch

from ._env import ParallelError

__all__ = ["DEFAULT_CHUNK_TOKENS", "chunked_cross_entropy"]

DEFAULT_CHUNK_TOKENS = 1024   # x 128k vocab x 4 B: 0.5 GiB of fp32 logits at a time


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on, else the input's."""
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, ignore_index, reduction, dtype):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_on = want_h or want_w
        n = hidden.shape[0]
        w = weight.to(dtype)
        acc = torch.promote_types(dtype, torch.float32)   # fp32 softmax, fp64 stays fp64
        valid = targets != ignore_index
        count = valid.sum()
        denom = count.clamp(min=1).to(acc) if reduction == "mean" else None
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        with torch.autocast(hidden.device.type, enabled=False):   # dtypes are chosen explicitly here
            for s in range(0, n, chunk):
                h = hidden[s:s + chunk].to(dtype)
                ok = valid[s:s + chunk]
                t = torch.where(ok, targets[s:s + chunk], 0)
                logits = (h @ w.t()).to(acc)
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, t[:, None]).squeeze(1)
                loss = loss + torch.where(ok, lse - picked, 0.0).sum()
                if not grad_on:
                    continue
                # d(loss)/d(logits) = softmax - onehot(target), zero on ignored rows; in place
                # in the logits' buffer, so a chunk never holds two fp32 copies
                g = logits.sub_(lse[:, None]).exp_()
                g.scatter_add_(1, t[:, None], torch.full_like(picked[:, None], -1.0))
                scale = ok.to(acc)
                if denom is not None:
                    scale = scale / denom
                g = (g * scale[:, None]).to(dtype)
                if want_h:
                    grad_h[s:s + chunk] = (g @ w).to(hidden.dtype)
                if want_w:
                    grad_w += (g.t() @ h).to(acc)
        if denom is not None:
            loss = loss / denom
        ctx.save_for_backward(grad_h if want_h else None,
                              grad_w.to(weight.dtype) if want_w else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_loss.to(grad_h.dtype) if grad_h is not None else None
        gw = grad_w * grad_loss.to(grad_w.dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          chunk_tokens: int = DEFAULT_CHUNK_TOKENS, ignore_index: int = -100,
                          reduction: str = "mean", dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets)`` computed ``chunk_tokens`` tokens at a time.

    Args:
        hidden: ``(..., dim)`` hidden states entering the head (after the final norm).
        weight: ``(vocab, dim)`` the head's weight (``lm_head.weight``; tied embeddings are fine).
        targets: ``(...)`` token ids, ``ignore_index`` where no loss is wanted.
        chunk_tokens: tokens per chunk; memory is ``chunk_tokens x vocab x 4`` bytes of logits.
        reduction: ``"mean"`` (over the targets that are not ignored) or ``"sum"``.
        dtype: the matmuls' dtype; default autocast's dtype when autocast is on, else ``hidden``'s.

    Returns the loss as an fp32 scalar (fp64 for fp64 inputs). Its backward gives ``hidden`` and ``weight`` the same
    gradients as the plain loss (``weight``'s summed over chunks in fp32).
    """
    if reduction not in ("mean", "sum"):
        raise ParallelError(f"chunked_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ParallelError(f"chunked_cross_entropy: chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ParallelError(f"chunked_cross_entropy: hidden {tuple(hidden.shape)} and weight "
                            f"{tuple(weight.shape)} do not match: weight must be (vocab, {hidden.shape[-1]})")
    if targets.shape != hidden.shape[:-1]:
        raise ParallelError(f"chunked_cross_entropy: targets {tuple(targets.shape)} must have hidden's "
                            f"leading shape {tuple(hidden.shape[:-1])}")
    h = hidden.reshape(-1, hidden.shape[-1])
    return _LinearCrossEntropy.apply(h, weight, targets.reshape(-1), chunk_tokens, ignore_index,
                                     reduction, dtype or _compute_dtype(hidden))

