"""The LLM recipes at real sequence length (issue 19), on CPU with the tiny shapes: generated
long chats that fill a sequence (``--data long``), TRL packing (``--packed``) and the attention
it relies on, the FLOP convention, and the numbers every run reports (steady tokens/s, MFU,
peak memory, the time split), each recomputed from the run's per-step record."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT
from test_recipes_llm import run_recipe

pytest.importorskip("trl")
pytest.importorskip("peft")


# ------------------------------------------------------------------ real length: data, packing
def test_long_chats_fill_the_sequence_and_hold_out_the_eval_values():
    from llm_common import chat_tokenizer, long_chat
    tok = chat_tokenizer.load_tokenizer()
    for seq_len in (512, 2048):
        rows = long_chat.long_conversations(tok, seq_len=seq_len, n_rows=6, held_out=False, seed=3)
        assert rows == long_chat.long_conversations(tok, seq_len=seq_len, n_rows=6,
                                                    held_out=False, seed=3)   # deterministic
        for row in rows:
            enc = tok.apply_chat_template(row["messages"], return_dict=True,
                                          return_assistant_tokens_mask=True)
            n = len(enc["input_ids"])
            assert 0.95 * seq_len <= n <= seq_len, (seq_len, n)
            roles = [m["role"] for m in row["messages"]]
            assert roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) > 20
            assert sum(enc["assistant_masks"]) > 0.2 * n      # answers are trained, all of them
    train_q = {m["content"] for r in long_chat.long_conversations(
        tok, seq_len=2048, n_rows=4, held_out=False, seed=3) for m in r["messages"]}
    eval_q = [m["content"] for r in long_chat.long_conversations(
        tok, seq_len=2048, n_rows=2, held_out=True, seed=4) for m in r["messages"]
        if m["role"] == "user" and m["content"].startswith(("What is", "Count"))
        and "capital" not in m["content"]]
    assert eval_q and not set(eval_q) & train_q


def test_long_preset_is_cached_and_sized_by_the_run(tmp_path, monkeypatch):
    from llm_common import chat_tokenizer, long_chat, options
    monkeypatch.setenv("GPULAUNCH_LLM_DATA_CACHE", str(tmp_path / "cache"))
    tok = chat_tokenizer.load_tokenizer()
    opts = options.RecipeOptions(recipe="t", data="long", seq_len=256, max_steps=5, batch_size=3,
                                 grad_accum=2, eval_batches=1)
    train, evaluation = long_chat.datasets_for(opts, tok, world_size=2)
    assert len(train) == 5 * 3 * 2 * 2 and len(evaluation) == 1 * 3 * 2
    files = sorted((tmp_path / "cache").glob("long-*.jsonl"))
    assert len(files) == 2
    stamp = [f.stat().st_mtime_ns for f in files]
    long_chat.datasets_for(opts, tok, world_size=2)        # second run: the same files, reused
    assert [f.stat().st_mtime_ns for f in files] == stamp


def test_padding_free_packing_keeps_attention_inside_each_row():
    """What --packed relies on without FlashAttention: TRL's bfd packing hands the model one
    flattened row with restarting position_ids and no attention mask, and transformers turns
    that into a block-diagonal mask for SDPA. The packed logits must equal each row's own."""
    import torch
    from llm_common import architectures, chat_tokenizer
    tok = chat_tokenizer.load_tokenizer()
    model = architectures.load_model(arch_name="llama-3.2-1b", model_path=None, full=False,
                                     tokenizer=tok, dtype=torch.float32, seed=0,
                                     attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(10, len(tok), (n,), generator=g) for n in (37, 50, 13)]
    packed = torch.cat(rows)[None]
    positions = torch.cat([torch.arange(len(r)) for r in rows])[None]
    with torch.no_grad():
        together = model(input_ids=packed, position_ids=positions).logits[0]
        alone = torch.cat([model(input_ids=r[None]).logits[0] for r in rows])
        crossed = model(input_ids=packed).logits[0]           # no positions: one long document
    assert torch.allclose(together, alone, atol=1e-4), (together - alone).abs().max()
    assert not torch.allclose(crossed, alone, atol=1e-3)     # the check can fail


def test_flops_per_token_follow_the_gpu_throughput_convention():
    import importlib.util

    from llm_common import architectures, chat_tokenizer, metrics
    tok = chat_tokenizer.load_tokenizer()
    spec = importlib.util.spec_from_file_location("gpu_throughput",
                                                  ROOT / "bench" / "gpu_throughput.py")
    sys.path.insert(0, str(ROOT / "bench"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from gpulaunch.parallel.reference_model import LLAMA_1B
    llama = architectures.build_config("llama-3.2-1b", full=True, tokenizer=tok)
    assert metrics.flops_per_token(llama, 2048) == bench.flops_per_token(LLAMA_1B, 2048)
    # MoE: only the experts a token visits count; OpenAI's published active sizes
    for name, active in (("gpt-oss-20b", 3.61e9), ("gpt-oss-120b", 5.13e9)):
        cfg = architectures.build_config(name, full=True, tokenizer=tok)
        assert abs(metrics.matmul_parameters(cfg) - active) / active < 0.01, name
    r = metrics.throughput(llama, seq_len=2048, tokens_per_second=50_000.0, world_size=2,
                           device="cpu", override_tflops=989)
    assert r["mfu"] == pytest.approx(50_000 * r["flops_per_token"] / (2 * 989e12))
    assert metrics.throughput(llama, seq_len=2048, tokens_per_second=1.0, world_size=1,
                              device="cpu")["mfu"] is None          # no peak for a CPU


def test_tiny_preset_extra_merges_and_user_settings_win():
    from llm_common import options
    defaults = options.RecipeOptions(recipe="t", extra={"a": 1, "b": 2})
    opts = options.parse(defaults, {"extra": {"b": 3, "c": 4}, "lr": 0.5},
                         argv=["-x", "c=5", "--lr", "0.1"])
    assert opts.extra == {"a": 1, "b": 3, "c": 5} and opts.lr == 0.1
    assert opts.started_at > 0 and opts.started_at <= __import__("time").time()


def _check_real_length_metrics(r, *, world: int, seq_len: int):
    steps, cap = r["steps"], r["micro_batch"] * r["grad_accum"] * world * seq_len
    assert len(r["step_tokens"]) == len(r["step_times"]) == steps
    assert all(0 < t <= cap for t in r["step_tokens"]) and r["fill"] > 0.9, r["step_tokens"]
    assert r["tokens"] == sum(r["step_tokens"])
    skip = r["warmup_steps_skipped"]
    steady = sum(r["step_tokens"][skip:]) / sum(r["step_times"][skip:])   # times: rounded
    assert r["steady_tokens_per_second"] == pytest.approx(steady, rel=1e-3)
    # -x peak_tflops=1: the MFU arithmetic, checked end to end
    assert r["mfu"] == pytest.approx(
        r["steady_tokens_per_second"] * r["flops_per_token"] / (1e12 * world), rel=1e-9)
    ts = r["time_split"]
    assert ts["steps_s"] == pytest.approx(sum(r["step_times"]), rel=1e-3)
    assert ts["startup_s"] > ts["launch_s"] > 0 and ts["eval_s"] > 0
    assert ts["outside_steps_s"] == pytest.approx(ts["total_s"] - ts["steps_s"])
    parts = (ts["startup_s"] + ts["steps_s"] + ts["eval_s"] + ts["train_other_s"] + ts["save_s"]
             + ts["after_s"])
    assert parts == pytest.approx(ts["total_s"], abs=0.5)
    assert r["peak_memory_gib"] > 0 and r["eval_loss_after"] < r["eval_loss_before"]


REAL_LENGTH = ("--seq-len", "512", "--batch-size", "2", "--max-steps", "6", "--eval-steps", "6",
               "--measure-after", "1", "--eval-batches", "1", "-x", "peak_tflops=1",
               "-x", "save=false")


@pytest.mark.slow
def test_trl_packing_fills_sequences_and_reports_throughput(tmp_path):
    """--packed: TRL packs the ~21-token shipped rows into 512-token padding-free batches."""
    r, _ = run_recipe("trl_sft_lora_ddp", tmp_path, "--packed", *REAL_LENGTH)
    assert r["technique"] == "ddp" and r["world_size"] == 2 and r["packed"]
    _check_real_length_metrics(r, world=2, seq_len=512)


@pytest.mark.slow
def test_long_chats_through_the_fsdp_recipe_report_throughput(tmp_path):
    """--data long through the FSDP recipe's code path (on CPU it runs as DDP, labelled so)."""
    r, proc = run_recipe("trl_sft_lora_fsdp", tmp_path, "--data", "long", "-x", "on_cpu=ddp",
                         *REAL_LENGTH)
    assert r["technique"] == "ddp" and r["data"] == "long" and not r["packed"]
    assert "NO GPU: FSDP IS NOT POSSIBLE HERE" in proc.stdout
    _check_real_length_metrics(r, world=2, seq_len=512)
