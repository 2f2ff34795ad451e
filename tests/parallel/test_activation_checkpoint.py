"""Activation checkpointing modes on one process: what backward recomputes (matmuls and attention
counted as they run, through a dispatch mode), and that every mode computes the same gradients."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpulaunch import parallel as gp
from gpulaunch.parallel.reference_model import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=64, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=64)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "mm" or "scaled_dot_product" in name:
            self.ops["attention" if "scaled_dot_product" in name and "backward" not in name else name] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops_and_grads(mode):
    torch.manual_seed(0)
    p = gp.prepare(Llama(CFG), None, strategy="none", activation_checkpointing=mode)
    x = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    loss = p.model(x, x)
    with _Count() as counted:
        loss.backward()
    return counted.ops, {n: q.grad.clone() for n, q in p.model.named_parameters()}


def test_selective_recomputes_half_the_matmuls_and_no_attention():
    none, g_none = _backward_ops_and_grads(False)
    full, g_full = _backward_ops_and_grads("full")
    sel, g_sel = _backward_ops_and_grads("selective")
    # a block's matmuls: q, k, v, o, w1, w3, w2. Full AC recomputes the first six (torch stops
    # recomputing once backward has what it needs: w2's output is not), and attention; selective
    # keeps q, v, w1, w2 and attention (every other matmul: the 1st, 3rd, ...) and recomputes k, o, w3.
    assert none["attention"] == 0
    assert full["mm"] - none["mm"] == 6 * CFG.n_layers and full["attention"] == CFG.n_layers
    assert sel["mm"] - none["mm"] == 3 * CFG.n_layers and sel["attention"] == 0
    for g in (g_full, g_sel):
        for n in g_none:
            torch.testing.assert_close(g[n], g_none[n], rtol=0, atol=1e-6)
