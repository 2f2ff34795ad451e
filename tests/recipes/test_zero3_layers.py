"""ZeRO-3 with each decoder layer one DeepSpeed unit (``gpulaunch.hf.zero3_layer_units``), so that
``compile_layers`` gives one graph per layer under DeepSpeed: real DeepSpeed ZeRO-3, real gloo
ranks, real torch.compile (CPU).

Without the units, DeepSpeed's per-submodule hooks (``torch.compiler.disable``d) sit inside the
compiled layer and break its graph at every linear and norm; the last test shows that, so the
middle one could fail."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import PY, ROOT, python_env

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

sys.path.insert(0, str(ROOT / "recipes"))

# one script, three modes: eager ZeRO-3, compiled layers as ZeRO-3 units, compiled layers with
# DeepSpeed's default per-submodule hooks. Every rank draws the same batches.
RUN = r'''
import json, os, sys, torch
import deepspeed
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
from gpulaunch.hf import compile_layers, zero3_layer_units
mode, out = sys.argv[1], sys.argv[2]
deepspeed.init_distributed(dist_backend="gloo")
cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg)
report = {}
if mode == "units":
    report["units"] = zero3_layer_units(model)
ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1280,
                            "overlap_comm": False, "contiguous_gradients": True,
                            # units: compiled, so torch's F.linear (DeepSpeed's is the default)
                            **({"memory_efficient_linear": False} if mode == "units" else {})},
      "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
engine, *_ = deepspeed.initialize(model=model, config=ds,
                                  optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
if mode != "eager":
    compile_layers(engine.module)
if mode == "units":
    try:
        zero3_layer_units(engine.module)
    except RuntimeError as e:
        report["late"] = str(e)
g = torch.Generator().manual_seed(1)
losses = []
for _ in range(5):
    ids = torch.randint(0, 512, (2, 64), generator=g)
    loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
if int(os.environ["RANK"]) == 0:
    report.update(losses=losses, linear=torch.nn.functional.linear.__name__,
                  breaks=sum(counters["graph_break"].values()),
                  graphs=counters["stats"].get("unique_graphs", 0),
                  partitioned=sum(p.ds_tensor.numel() < p.ds_numel for p in model.parameters()))
    with open(out, "w") as f:
        json.dump(report, f)
'''


def _run(tmp_path, mode: str, ranks: int) -> dict:
    script = tmp_path / "zero3_run.py"
    script.write_text(RUN)
    out = tmp_path / f"{mode}.json"
    proc = subprocess.run(
        [PY, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--standalone",
         str(script), mode, str(out)],
        env=python_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_compiled_layers_as_zero3_units_are_one_graph_with_eager_losses(tmp_path):
    eager = _run(tmp_path, "eager", 2)
    units = _run(tmp_path, "units", 2)
    assert units["units"] == {"units": 4, "layer": "LlamaDecoderLayer", "restored_linear": False}
    # DeepSpeed's default replaces F.linear process-wide; the compiled run keeps torch's
    assert eager["linear"] == "zero3_linear_wrap" and units["linear"] == "linear", (eager, units)
    assert units["partitioned"] > 0                 # two ranks: the matrices really are sharded
    assert units["breaks"] == 0 and units["graphs"] == 1, units
    assert units["losses"] == pytest.approx(eager["losses"], rel=1e-5, abs=1e-5)
    assert eager["losses"][-1] < eager["losses"][0]
    assert "before deepspeed.initialize" in units["late"]


@pytest.mark.slow
def test_without_units_deepspeeds_hooks_break_the_compiled_layer(tmp_path):
    hooked = _run(tmp_path, "hooked", 1)
    assert hooked["breaks"] > 4 and hooked["graphs"] > 1, hooked


def test_recipes_make_units_before_compiling_under_zero3():
    from llm_common import speed
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpulaunch.hf import speed_settings
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    s = speed_settings(cfg, technique="zero3", device="cpu", compile=True)
    trainer = SimpleNamespace(model=LlamaForCausalLM(cfg))
    report = speed.compile_layers(trainer, s)
    assert report["compiled"] == 2 and report["zero3_units"] == 2
    assert all(layer._z3_leaf for layer in trainer.model.model.layers)
    assert speed.summary(s)["zero3_layers"]["value"] is True
    ddp = speed_settings(cfg, technique="ddp", device="cpu", compile=True)
    plain = SimpleNamespace(model=LlamaForCausalLM(cfg))
    report = speed.compile_layers(plain, ddp)
    assert report["compiled"] == 2 and "zero3_units" not in report
    assert not any(getattr(m, "_z3_leaf", False) for m in plain.model.modules())


def test_zero3_layer_units_refuses_a_model_without_layers():
    from gpulaunch.hf import zero3_layer_units
    with pytest.raises(ValueError, match="no repeated layers"):
        zero3_layer_units(torch.nn.Linear(2, 2))
