"""torch.compile in the LLM speed path never lets a frame reach Dynamo's recompile limit (after
which that frame runs eagerly for the rest of training).

The cause it guards against: transformers wraps the forwards of the causal LM, the base model,
every decoder layer and attention in ``deprecate_kwarg``, one ``wrapped_func`` code object for
all of them. When something inside the layers breaks the graph (Liger's Triton RMSNorm did, on
a GPU), those forwards become frames of their own and their call patterns fill that one code
object's cache. ``speed_settings`` therefore leaves Liger's layer kernels off under compile; the
first test shows the mechanism on CPU (a ``torch._dynamo.disable``d RMSNorm stands in for the
Triton kernel).

The second cause only shows on a GPU: TRL's chunked LM head scores only the positions with a
label (``hidden[mask]``), a new shape every batch, and the whole model compiled then spent
minutes recompiling (H100: no step in 240 s). So the recipes compile the decoder layers only
(``gpulaunch.hf.compile_layers``); the tests below check that only the layer forward is ever a
compiled frame, one graph for every layer, the same numbers as eager, and a recipe run that
compiles its layers and nothing else."""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import subprocess
import sys

import pytest
from conftest import PY, ROOT, python_env

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

sys.path.insert(0, str(ROOT / "recipes"))

LIMIT = "hit config.recompile_limit"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def recompiles_by_function(lines) -> collections.Counter:
    """``TORCH_LOGS=recompiles`` lines -> recompiles per function name."""
    return collections.Counter(m.group(1) for line in lines
                               if (m := re.search(r"Recompiling function (\S+)", line)))


@pytest.fixture
def dynamo_log():
    records = _Records()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(records)
    torch._dynamo.reset()
    torch._logging.set_logs(recompiles=True)
    yield records
    torch._logging.set_logs()
    logger.removeHandler(records)
    torch._dynamo.reset()


def _train_compiled_lora_llama(steps=6):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpulaunch.hf import fuse_lora
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules="all-linear"))
    fuse_lora(model)
    model = torch.compile(model)        # what TrainingArguments(torch_compile=True) does
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    for step, length in enumerate([60, 64, 70, 61, 66, 72][:steps]):   # rows of varying length
        ids = torch.randint(0, 128, (2, length))
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 2:                     # evaluation between steps: no grad
            model.eval()
            with torch.no_grad():
                model(input_ids=ids, labels=ids)


def test_a_graph_break_in_the_layers_sends_wrapped_func_past_the_limit(dynamo_log, monkeypatch):
    from transformers.models.llama import modeling_llama
    eager_norm = modeling_llama.LlamaRMSNorm.forward

    @torch._dynamo.disable        # what an untraced kernel call in every layer amounts to
    def opaque_norm(self, x):
        return eager_norm(self, x)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", opaque_norm)
    from llm_common import speed
    recorded = speed._RecompileLimitHits()       # what the recipes record in their result
    logging.getLogger("torch._dynamo").addHandler(recorded)
    try:
        _train_compiled_lora_llama()
    finally:
        logging.getLogger("torch._dynamo").removeHandler(recorded)
    counts = recompiles_by_function(dynamo_log.messages)
    hits = [m for m in dynamo_log.messages if LIMIT in m]
    assert any("wrapped_func" in m for m in hits), (counts, hits)
    assert counts["wrapped_func"] == torch._dynamo.config.recompile_limit, counts
    assert "wrapped_func" in recorded.functions, recorded.functions


def test_without_the_break_no_frame_reaches_the_limit(dynamo_log):
    _train_compiled_lora_llama()
    counts = recompiles_by_function(dynamo_log.messages)
    limit = torch._dynamo.config.recompile_limit
    assert not [m for m in dynamo_log.messages if LIMIT in m], counts
    assert max(counts.values(), default=0) < limit // 2, counts
    assert "wrapped_func" not in counts, counts     # inlined, never a frame of its own


def _lora_llama(layers=3):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpulaunch.hf import fuse_lora
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules="all-linear"))
    fuse_lora(model)
    return model


def _traced(messages) -> list[tuple[str, str]]:
    """(function, how tracing ended) for every frame Dynamo compiled (``dynamo`` INFO logs)."""
    return [(m.group(1), m.group(2)) for line in messages
            if (m := re.search(r"torchdynamo done tracing (\S+) \((\w+)\)", line))]


def test_compile_layers_compiles_one_graph_for_every_layer_and_nothing_else(dynamo_log):
    from gpulaunch.hf import compile_layers
    torch._logging.set_logs(recompiles=True, dynamo=logging.INFO)
    model = _lora_llama(layers=3)
    report = compile_layers(model)
    assert report == {"compiled": 3, "layer": "LlamaDecoderLayer", "output_capture": "traced"}
    layer_fn = type(model.base_model.model.model.layers[0]).forward.__code__.co_name
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    for step, length in enumerate([60, 64, 70, 61, 66, 72]):   # rows of varying length
        ids = torch.randint(0, 128, (2, length))
        model.train()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()   # as TRL calls it
        opt.step()
        opt.zero_grad()
        if step % 2:
            model.eval()
            with torch.no_grad():
                model(input_ids=ids, labels=ids, use_cache=False)
    traced = _traced(dynamo_log.messages)
    assert traced, "Dynamo logged no compiled frame: the checks below would prove nothing"
    # only the layer's forward is a frame (the LM head, the loss, the embedding stay eager), and
    # each is one whole graph (a graph break would end tracing elsewhere than its return)
    assert {fn for fn, _ in traced} == {layer_fn}, traced
    assert {end for _, end in traced} == {"RETURN_VALUE"}, traced
    # one cache for all 3 layers: layer 0's input needs no grad (a frozen embedding), the others'
    # does; static then dynamic length; training and eval. Never one entry per layer.
    counts = recompiles_by_function(dynamo_log.messages)
    assert not [m for m in dynamo_log.messages if LIMIT in m], counts
    assert counts[layer_fn] <= 4, counts


def test_compile_layers_gives_eager_numbers_and_keeps_the_state_dict():
    from gpulaunch.hf import compile_layers, uncompile_layers
    from gpulaunch.hf.regional_compile import find_layers
    torch._dynamo.reset()
    model = _lora_llama(layers=2)
    keys = list(model.state_dict())
    ids = torch.randint(0, 128, (2, 24))

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    eager_loss, eager_grads = loss_and_grads()
    assert compile_layers(model)["compiled"] == 2
    assert compile_layers(model)["compiled"] == 0          # a second call changes nothing
    loss, grads = loss_and_grads()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    assert list(model.state_dict()) == keys                # no _orig_mod. prefix
    assert uncompile_layers(model) == 2
    assert all("forward" not in layer.__dict__ for layer in find_layers(model))
    with pytest.raises(ValueError, match=r"no repeated layers.*torch\.compile\(model\)"):
        compile_layers(torch.nn.Linear(2, 2))
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_lora_recipe_stays_under_the_recompile_limit(tmp_path):
    pytest.importorskip("trl")
    results = tmp_path / "r.json"
    env = python_env({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                      "TOKENIZERS_PARALLELISM": "false", "HF_HOME": str(tmp_path / "hf-home"),
                      "TMPDIR": str(tmp_path), "TORCH_LOGS": "recompiles,dynamo",
                      "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "recipes")])})
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [PY, str(ROOT / "recipes" / "trl_sft_lora_ddp.py"), "--results", str(results),
           "--arch", "llama-3.2-1b", "--gpus", "1", "--data", "long", "--seq-len", "256",
           "--batch-size", "2", "--max-steps", "4", "--measure-after", "1", "--eval-steps", "2",
           "--eval-batches", "1", "--report-to", "none", "--lora-r", "8", "--lora-dropout", "0",
           "-x", "save=false", "-x", "compile=true"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    r = json.loads(results.read_text())
    assert r["speed"]["compile_layers"]["value"] is True
    assert r["speed"]["torch_compile"]["value"] is False         # not the whole model
    assert r["compiled_layers"]["layer"] == "LlamaDecoderLayer"
    assert r["compiled_layers"]["compiled"] >= 2, r["compiled_layers"]    # every layer of the tiny shape
    assert r["speed"]["recompile_limit_hits"]["value"] == []     # what a GPU run records too
    traced = _traced(out.splitlines())
    assert traced, "TORCH_LOGS=dynamo logged no compiled frame: the checks would prove nothing"
    # the layers only: TRL's fused LM head (_fused_forward, the chunked log-prob) stays eager
    assert {fn for fn, _ in traced} == {"forward_with_checkpointing"}, traced
    assert {end for _, end in traced} == {"RETURN_VALUE"}, traced
    counts = recompiles_by_function(out.splitlines())
    assert LIMIT not in out, counts
    assert max(counts.values(), default=0) <= 4, counts
