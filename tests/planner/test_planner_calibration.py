"""The activation formulas against bytes autograd really saves, on CPU (device independent).

Needs transformers (and peft for LoRA); skipped without them. This is what makes the GPU check a
confirmation rather than a fit."""
import contextlib

import pytest

from gpulaunch.planner import ModelShape
from gpulaunch.planner import activations as act
from gpulaunch.planner.training_setup import TrainingSetup

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPE = ModelShape("t", vocab_size=1000, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=48,
                   intermediate_size=688)


def _saved_per_layer(mode: str, batch: int) -> int:
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=48,
                                   attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg)
    ctx = contextlib.nullcontext()
    if mode == "autocast":
        ctx = torch.autocast("cpu", dtype=torch.bfloat16)
    else:
        m = m.to(torch.bfloat16)
    if mode.startswith("lora"):
        peft = pytest.importorskip("peft")
        m = peft.get_peft_model(m, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
        if mode == "lora-bf16":
            m = m.to(torch.bfloat16)
    layer = m.get_decoder().layers[1]   # layer 0's input needs no grad under LoRA: use layer 1
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    inside, saved = [False], {}
    layer.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *a: inside.__setitem__(0, False))

    def pack(t):
        st = t.untyped_storage()
        if inside[0] and st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randint(0, 1000, (batch, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        m(input_ids=x, labels=x)
    return sum(saved.values())


@pytest.mark.parametrize("mode,act_mode,adapter_bytes", [
    ("pure", act.PURE, 2), ("autocast", act.AUTOCAST, 2), ("lora-fp32", act.PURE, 4), ("lora-bf16", act.PURE, 2)])
def test_block_formula_matches_saved_tensors(mode, act_mode, adapter_bytes):
    # The slope over the batch size removes per-sequence constants (rotary tables) and weight casts.
    per_token = (_saved_per_layer(mode, 4) - _saved_per_layer(mode, 2)) / (2 * 64)
    setup = TrainingSetup(micro_batch_size=1, seq_len=1, precision="bf16",
                          lora_rank=8 if mode.startswith("lora") else None)
    predicted = act.profile(SHAPE, setup, act_mode, adapter_bytes).per_layer
    assert abs(predicted - per_token) <= 0.01 * per_token + 16, (predicted, per_token)
