"""gpt-oss under ``--speed auto``, on CPU: the choices ``speed_settings`` makes for it (with the
GPU facts given), and that each fast path computes what the seed's path computes on a tiny
gpt-oss (2 layers, one sliding-window and one full, 4 experts, LoRA on all linear layers):

- attention sinks through SDPA (``gpulaunch.hf.sink_attention``) vs transformers' eager
  attention: logits, loss and every gradient (LoRA and the sinks themselves), with and without
  padding;
- transformers' ``grouped_mm`` experts vs its eager loop over experts: the same;
- the decoder layers compiled (grouped experts, sink attention): no graph break, same numbers;
  also with the router logits captured (TRL's aux loss), no recompile per step.

Not timings: those are ``bench/llm_speed.py --group gptoss`` on a GPU."""
from __future__ import annotations

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "recipes"))
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from gpulaunch.hf import speed_settings  # noqa: E402
from gpulaunch.hf.sink_attention import NAME, register  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8, max_position_embeddings=4096,
            layer_types=["sliding_attention", "full_attention"], use_cache=False)


def _gpt_oss_20b() -> dict:
    from llm_common import architectures
    return {**architectures.get("gpt-oss-20b").full, "model_type": "gpt_oss"}


@pytest.fixture
def as_if_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    return dict(device="cuda", gpu_memory_bytes=141 * 2**30)


# ------------------------------------------------------------------ the choices
@pytest.mark.unit
def test_gpt_oss_20b_on_an_h200(as_if_gpu):
    for mb in (1, 2):
        s = speed_settings(_gpt_oss_20b(), technique="ddp", seq_len=2048, micro_batch_size=mb,
                           lora_rank=8, **as_if_gpu)
        a, m, why = s.trainer_args, s.model_kwargs, s.reasons
        assert m["attn_implementation"] == NAME and "sink" in why["attn_implementation"]
        assert m["experts_implementation"] == "grouped_mm" and "grouped" in why["experts_implementation"]
        assert s.compile_layers is True and a["torch_compile"] is False
        assert "grouped_mm" in why["compile_layers"]
        assert a["use_liger_kernel"] is False and a["pad_to_multiple_of"] == 64
        # 39 GiB of bf16 weights; the planner's activations at mb 1-2 x 2048 fit 141 GiB
        assert a["gradient_checkpointing"] is False and "planner" in why["gradient_checkpointing"]
        assert a["padding_free"] is False and s.fuse_lora is True
    # the name is registered with transformers by the call
    from transformers import AttentionInterface
    assert NAME in AttentionInterface._global_mapping


@pytest.mark.unit
def test_moe_compile_stays_off_where_it_would_break(as_if_gpu, monkeypatch):
    cfg = _gpt_oss_20b()
    experts = speed_settings(cfg, technique="fsdp2", lora_rank=32, adapted_experts=True,
                             **as_if_gpu)
    assert experts.compile_layers is False and "parametrized" in experts.reasons["compile_layers"]
    # ZeRO-3: each layer one ZeRO-3 unit (DeepSpeed hooks around it), so grouped experts compile
    z3 = speed_settings(cfg, technique="zero3", **as_if_gpu)
    assert z3.compile_layers is True and z3.zero3_layers is True
    # an MoE whose experts transformers loops over (no experts interface): not compiled
    looped = {**cfg, "model_type": None}
    s = speed_settings(looped, gradient_checkpointing=False, **as_if_gpu)
    assert s.compile_layers is False and "loops over experts" in s.reasons["compile_layers"]
    assert "experts_implementation" not in s.model_kwargs
    # FlashAttention-2 has no sinks: never chosen for gpt-oss, even when installed
    import gpulaunch.hf.speed as speed_mod
    monkeypatch.setattr(speed_mod, "_installed", lambda module: True)
    s = speed_settings(cfg, **as_if_gpu)
    assert s.model_kwargs["attn_implementation"] == NAME and s.trainer_args["padding_free"] is False


@pytest.mark.unit
def test_gpt_oss_on_cpu_takes_the_exact_paths_only():
    s = speed_settings(_gpt_oss_20b(), device="cpu", lora_rank=8)
    assert s.model_kwargs["attn_implementation"] == NAME
    assert s.compile_layers is False and s.trainer_args["gradient_checkpointing"] is False


# ------------------------------------------------------------------ the numbers
def _model(attn="eager", experts="eager", dtype=None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GptOssConfig
    register()
    torch.manual_seed(0)
    kw = {"dtype": dtype} if dtype else {}
    m = AutoModelForCausalLM.from_config(GptOssConfig(**TINY), attn_implementation=attn,
                                         experts_implementation=experts, **kw)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)       # sinks that matter (init is 0)
    p = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                     task_type="CAUSAL_LM", init_lora_weights=False))
    for name, param in p.named_parameters():
        if "sinks" in name:
            param.requires_grad_(True)
    return p


def _step(model, ids, mask=None):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    grads = {n: x.grad.float().clone() for n, x in model.named_parameters() if x.grad is not None}
    return out.loss.detach(), out.logits.detach().float(), grads


def _close(a, b, atol):
    la, lg, ga = a
    lb, lgb, gb = b
    assert torch.allclose(la, lb, atol=atol), (la, lb)
    assert ga.keys() == gb.keys() and len(ga) > 0
    for n in ga:
        assert torch.allclose(ga[n], gb[n], atol=atol), (n, (ga[n] - gb[n]).abs().max())


@pytest.mark.unit
def test_sink_attention_equals_eager_forward_and_backward():
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    pad = torch.ones(2, 40, dtype=torch.long)
    pad[1, :7] = 0                                    # left padding in one row
    eager, sdpa = _model("eager"), _model(NAME)
    assert sdpa.config._attn_implementation == NAME
    for mask in (None, pad):
        a, b = _step(eager, ids, mask), _step(sdpa, ids, mask)
        _close(a, b, atol=1e-5)
        assert any("sinks" in n for n in a[2])        # the sinks' own gradient is compared too
        assert torch.allclose(a[1][0], b[1][0], atol=1e-5)
        assert torch.allclose(a[1][1, 7:], b[1][1, 7:], atol=1e-5)   # real tokens of row 1


@pytest.mark.unit
def test_grouped_mm_experts_equal_the_eager_loop():
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    a = _step(_model(NAME, "eager"), ids)
    g = _model(NAME, "grouped_mm")
    assert g.config._experts_implementation == "grouped_mm"
    _close(a, _step(g, ids), atol=1e-5)


@pytest.mark.slow
def test_compiled_gpt_oss_layers_have_no_graph_break_and_the_same_numbers():
    from torch._dynamo.utils import counters

    from gpulaunch.hf import compile_layers, fuse_lora
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3))
    ref = _step(_model(NAME, "grouped_mm"), ids)
    model = _model(NAME, "grouped_mm")
    fuse_lora(model)
    torch._dynamo.reset()
    counters.clear()
    assert compile_layers(model) == {"compiled": 2, "layer": "GptOssDecoderLayer",
                                     "output_capture": "traced"}
    for _ in range(2):
        got = _step(model, ids)
    _close(ref, got, atol=1e-5)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] <= 2    # layer 0 (input without grad), the rest


class _ContextVarAsOldTorchSeesIt:
    """transformers' collector ``ContextVar`` with a ``get`` Dynamo will not trace: what torch
    before 2.14 made of ``ContextVar.get`` (a graph break in each output hook inside a compiled
    layer: 19 logged on the H100, torch 2.11), here on any torch. Not a subclass: ContextVar
    allows none."""

    def __init__(self, var):
        self.var = var

    @torch._dynamo.disable
    def get(self, *default):
        return self.var.get(*default)

    def set(self, value):
        return self.var.set(value)

    def reset(self, token):
        self.var.reset(token)


def _aux_step(model, ids):
    """One step as TRL's SFTTrainer takes it for a MoE with ``router_aux_loss_coef``:
    ``output_router_logits=True``, so transformers' output hooks record every router's logits
    (hooks on modules inside the compiled layers) and the loss includes the aux loss."""
    model.zero_grad()
    out = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    out.loss.backward()
    grads = {n: x.grad.float().clone() for n, x in model.named_parameters() if x.grad is not None}
    return out.loss.detach(), out.aux_loss.detach(), [r.detach() for r in out.router_logits], grads


@pytest.mark.slow
def test_compiled_layers_capture_router_logits_without_graph_breaks_or_recompiles(monkeypatch):
    from torch._dynamo.utils import counters
    from transformers.utils import output_capturing

    from gpulaunch.hf import compile_layers, fuse_lora
    var = output_capturing._active_collector
    monkeypatch.setattr(var, "context_var", _ContextVarAsOldTorchSeesIt(var.context_var))
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(4))
    ref = _aux_step(_model(NAME, "grouped_mm"), ids)
    assert len(ref[2]) == 2 and ref[1] > 0             # one router per layer; an aux loss
    model = _model(NAME, "grouped_mm")
    fuse_lora(model)
    torch._dynamo.reset()
    counters.clear()
    report = compile_layers(model)
    graphs = []
    for _ in range(6):                                  # a new collector dict every forward
        got = _aux_step(model, ids)
        graphs.append(counters["stats"]["unique_graphs"])
    assert dict(counters["graph_break"]) == {}
    # layer 0 (input without grad) and the rest, both compiled in step 1; nothing after
    assert graphs[0] <= 2 and graphs == graphs[:1] * 6, graphs
    loss, aux, routers, grads = got
    torch.testing.assert_close(loss, ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(aux, ref[1], rtol=1e-6, atol=1e-6)
    assert len(routers) == 2
    for r, e in zip(routers, ref[2]):
        torch.testing.assert_close(r, e, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref[3].keys() and any("lora" in n for n in grads)
    for n in grads:
        torch.testing.assert_close(grads[n], ref[3][n], rtol=1e-5, atol=1e-6, msg=n)
    # without the capture asked for, the same graphs serve (no hook records anything)
    _step(model, ids)
    assert counters["stats"]["unique_graphs"] <= graphs[0] + 2
    assert report["output_capture"] == "traced"


@pytest.mark.unit
def test_compile_layers_falls_back_where_transformers_has_no_compileable_collector(monkeypatch):
    from transformers.utils import output_capturing

    from gpulaunch.hf import compile_layers
    monkeypatch.delattr(output_capturing, "_active_collector")
    model = _model(NAME, "grouped_mm")
    report = compile_layers(model)
    assert report["compiled"] == 2 and "no CompileableContextVar" in report["output_capture"]
    layer = model.base_model.model.model.layers[0]
    assert hasattr(layer.forward, "_torchdynamo_orig_callable")   # the compiled forward itself


@pytest.mark.unit
def test_sink_attention_keeps_no_heads_x_t_x_t_scores_for_backward():
    """Bytes autograd keeps for one gpt-oss attention call (64 heads of 64, 8 kv heads, bf16):
    eager keeps the heads x T x (T+1) probabilities; SDPA keeps q, k, v (padded to 72), the
    output, its log-sum-exp and the boolean mask."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    from gpulaunch.hf.sink_attention import sdpa_sinks_attention_forward
    t, heads, kv, d = 1024, 64, 8, 64

    class Attn(torch.nn.Module):
        num_key_value_groups, training = heads // kv, True

    def kept(fn) -> int:
        q = torch.randn(1, heads, t, d, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, kv, t, d, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        module = Attn()
        module.sinks = torch.zeros(heads, dtype=torch.bfloat16)
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        seen = {}

        def pack(x):
            seen[x.data_ptr()] = x.untyped_storage().nbytes()
            return x
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            if fn == "eager":
                additive = torch.zeros(t, t, dtype=torch.bfloat16).masked_fill(~causal, -1e4)
                modeling_gpt_oss.eager_attention_forward(module, q, k, v, additive,
                                                         scaling=d ** -0.5)
            else:
                sdpa_sinks_attention_forward(module, q, k, v, causal, scaling=d ** -0.5,
                                             s_aux=module.sinks)
        return sum(seen.values())
    scores = heads * t * (t + 1) * 2
    assert kept("eager") >= scores
    # linear in T: q, k, v, output (72 wide) and the log-sum-exp, plus the (T+1)-wide mask
    # (boolean, and the kernel's own additive copy): measured 40 MB here, 134 MB for eager
    assert kept("sdpa") <= 5 * heads * t * 72 * 2 + 4 * t * (t + 1) < scores / 2
