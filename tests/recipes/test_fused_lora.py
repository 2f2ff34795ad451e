"""gpulaunch.hf.fused_lora against peft itself: same logits, same gradients, same saved adapter.

A tiny random LlamaForCausalLM (built from a config, no downloads) with peft LoRA r 8 on every
linear layer; lora_B is drawn at random so the adapters are not the zero update of a fresh one.
"""
import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from gpulaunch.hf import fused_lora  # noqa: E402
from gpulaunch.hf.fused_lora import FusedLoraLinear, fuse_lora, unfuse_lora  # noqa: E402

VOCAB = 128


def tiny_base(layers=2, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                      max_position_embeddings=64, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype)


def lora_model(base, dropout=0.0, seed=1, **kw):
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout,
                                            target_modules="all-linear", bias="none",
                                            task_type="CAUSAL_LM", **kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def batch(mb=2, seq=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (mb, seq), generator=g)


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("mode", fused_lora.MODES)
def test_fused_matches_peft_logits_and_gradients(mode, monkeypatch):
    calls = []
    real = fused_lora.lora_linear_merged
    monkeypatch.setattr(fused_lora, "lora_linear_merged", lambda *a: calls.append(1) or real(*a))
    ref = lora_model(tiny_base())
    fast = copy.deepcopy(ref)
    report = fuse_lora(fast, mode=mode)
    # 2 layers x (q, k, v, o, gate, up, down); lm_head is not targeted by all-linear
    assert report == {"fused": 14, "skipped": {}, "mode": mode}
    ids = batch()
    logits_r, loss_r, grads_r = loss_and_grads(ref, ids)
    logits_f, loss_f, grads_f = loss_and_grads(fast, ids)
    assert len(calls) == (14 if mode == "merged" else 0)    # the fused path ran, no fallback
    torch.testing.assert_close(logits_f, logits_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_f, loss_r)
    assert grads_f.keys() == grads_r.keys() and len(grads_r) == 28
    for name in grads_r:
        torch.testing.assert_close(grads_f[name], grads_r[name], rtol=1e-4, atol=1e-6, msg=name)


def test_input_gradient_matches_when_the_base_is_trained_too():
    """Embedding inputs that need a gradient (gradient checkpointing's enable_input_require_grads)
    and a trained base weight: the hand-written backward gives every gradient autograd would."""
    ref = lora_model(tiny_base(layers=1))
    for name, p in ref.named_parameters():
        if "q_proj.base_layer" in name:
            p.requires_grad_(True)
    fast = copy.deepcopy(ref)
    fuse_lora(fast)
    emb = torch.randn(2, 8, 64)
    outs = []
    for m in (ref, fast):
        x = emb.clone().requires_grad_(True)
        m.zero_grad(set_to_none=True)
        m(inputs_embeds=x).logits.square().mean().backward()
        outs.append((x.grad, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-6)
    assert any("q_proj.base_layer" in n for n in outs[0][1])
    for n, g in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_bf16_base_with_fp32_adapters_runs_in_bf16():
    """peft keeps adapters fp32 beside a bf16 base; the fused path computes in bf16 (the
    activations' dtype) and returns the same dtype as peft, close to peft's fp32 adapter maths."""
    ref = lora_model(tiny_base(dtype=torch.bfloat16))
    assert ref.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    fast = copy.deepcopy(ref)
    fuse_lora(fast)
    ids = batch()
    logits_r, _, grads_r = loss_and_grads(ref, ids)
    logits_f, _, grads_f = loss_and_grads(fast, ids)
    assert logits_f.dtype == logits_r.dtype
    torch.testing.assert_close(logits_f.float(), logits_r.float(), rtol=0.05, atol=0.05)
    for n, g in grads_r.items():
        assert grads_f[n].dtype == torch.float32          # the adapters stay fp32 masters
        cos = torch.nn.functional.cosine_similarity(grads_f[n].flatten(), g.flatten(), dim=0)
        assert cos > 0.98, (n, float(cos))


def test_dropout_takes_the_split_form_and_the_same_mask_as_peft(monkeypatch):
    fallbacks = []
    peft_forward = fused_lora.PeftLoraLinear.forward

    def counting(self, *a, **kw):
        if isinstance(self, FusedLoraLinear):
            fallbacks.append(1)
        return peft_forward(self, *a, **kw)

    monkeypatch.setattr(fused_lora.PeftLoraLinear, "forward", counting)
    base = tiny_base(layers=1)
    plain_logits = base(input_ids=batch()).logits.detach()
    ref = lora_model(base, dropout=0.1)
    fast = copy.deepcopy(ref)
    fuse_lora(fast)
    ids = batch()
    # dropout active in training: the split form, with peft's dropout module (same mask)
    ref.train(), fast.train()
    torch.manual_seed(5)
    a = ref(input_ids=ids).logits
    torch.manual_seed(5)
    b = fast(input_ids=ids).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # eval mode: dropout is off, the merged form runs and matches
    ref.eval(), fast.eval()
    torch.testing.assert_close(fast(input_ids=ids).logits, ref(input_ids=ids).logits,
                               rtol=1e-5, atol=1e-5)
    assert not fallbacks
    # adapters disabled: peft's own forward, i.e. the base model's logits
    with fast.disable_adapter():
        torch.testing.assert_close(fast(input_ids=ids).logits, plain_logits, rtol=1e-5, atol=1e-5)
    assert len(fallbacks) == 7


def test_unfusable_modules_are_reported_not_fused():
    report = fuse_lora(lora_model(tiny_base(layers=1), use_dora=True))
    assert report["fused"] == 0 and len(report["skipped"]) == 7
    assert all("variant" in why for why in report["skipped"].values())
    with pytest.raises(ValueError, match="get_peft_model"):
        fuse_lora(tiny_base(layers=1))
    with pytest.raises(ValueError, match="merged, split"):
        fuse_lora(lora_model(tiny_base(layers=1)), mode="fast")


def test_unfuse_and_pickle_keep_the_same_module():
    model = lora_model(tiny_base(layers=1))
    keys = list(model.state_dict())
    fuse_lora(model)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, FusedLoraLinear) and list(model.state_dict()) == keys
    clone = pickle.loads(pickle.dumps(model))
    ids = batch()
    torch.testing.assert_close(clone(input_ids=ids).logits, model(input_ids=ids).logits)
    assert unfuse_lora(model) == 7 and type(q).__name__ == "Linear"
    assert list(model.state_dict()) == keys


def test_compiled_fused_model_matches_eager_peft():
    """torch.compile traces the fused forward and its hand-written backward in one graph
    (fullgraph: no break in any LoRA layer). aot_eager keeps the test cheap on a CPU."""
    ref = lora_model(tiny_base(layers=1))
    fast = copy.deepcopy(ref)
    fuse_lora(fast)
    compiled = torch.compile(fast, backend="aot_eager", fullgraph=True)
    ids = batch()
    logits_r, _, grads_r = loss_and_grads(ref, ids)
    logits_c, _, grads_c = loss_and_grads(compiled, ids)
    torch.testing.assert_close(logits_c, logits_r, rtol=1e-5, atol=1e-5)
    for n, g in grads_r.items():
        key = n if n in grads_c else f"_orig_mod.{n}"
        torch.testing.assert_close(grads_c[key], g, rtol=1e-4, atol=1e-6, msg=n)


def test_adapter_trained_fused_loads_back_in_plain_peft(tmp_path):
    model = lora_model(tiny_base())
    fuse_lora(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = batch(seq=24)
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.save_pretrained(tmp_path / "adapter")
    model.eval()
    trained = model(input_ids=ids).logits.detach()
    reloaded = PeftModel.from_pretrained(tiny_base(), tmp_path / "adapter").eval()
    assert not any(isinstance(m, FusedLoraLinear) for m in reloaded.modules())
    torch.testing.assert_close(reloaded(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)
