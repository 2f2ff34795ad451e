"""Three groups of ``bench/llm_speed.py``, planned here to keep that script short: ``gptoss``,
``qlora`` and ``foundry``. Each takes the script's row factory (``llm_speed._recipe``) and the shared run
shape (``llm_recipes_gpu._shape``), so that every row is built the same way as the others."""

from __future__ import annotations

GPTOSS_STEPS = 48          # 40 steady steps: ~49 s plain (3.3k tokens/s), ~20 s at 8k
QLORA_STEPS = 24           # 18 steady steps after 6 of warm-up (~2.3 s a step on an H100)
QLORA_SKIP = 6             # eager TRL over Linear4bit stalled at steps 3-4 on 2026-12-07 (below)


def gptoss_plan(smoke: bool, recipe, shape_of) -> list:
    """The seed's gpt-oss-20b row (bench/llm_recipes_gpu.py phase 2, ``--speed off``) against
    ``--speed auto``, the same steps; the fast run drops the seed's explicit
    ``--gradient-checkpointing`` and ``--attn eager`` (they would win over ``--speed auto``)."""
    group, nosave = "gptoss", ["-x", "save=false"]
    steps = 4 if smoke else GPTOSS_STEPS

    def shape(*more, mb=1, ga=2):
        return shape_of(smoke, "gpt-oss-20b", 2048, mb, ga, steps, "--measure-after",
                        "8", "--eval-batches", "1", *more, *nosave)
    seed = ["--gradient-checkpointing", *([] if smoke else ["--attn", "eager"])]
    mb2 = ["--batch-size", "2", "--grad-accum", "1"] if smoke else []

    def fast(label, row, *more, est_s=150, **kw):
        return recipe(label, group, "trl_sft_lora_ddp", shape(*more, **kw), role="variant",
                      row=row, est_s=est_s, smoke=smoke)
    rows = [recipe("gptoss_plain", group, "trl_sft_lora_ddp",
                   shape("--speed", "off", *seed), role="plain", est_s=90, smoke=smoke,
                   row="gpt-oss-20b trl_sft_lora_ddp --speed off (seed: mb 1 x ga 2, grad. "
                       "ckpt, eager attention)"),
            fast("gptoss_fast", "gpt-oss-20b --speed auto (mb 1 x ga 2)", "--speed", "auto"),
            # is compiling the MoE layers worth its compile time? (cheap: no compile)
            fast("gptoss_fast_eager", "gpt-oss-20b --speed auto -x compile=false", "--speed",
                 "auto", "-x", "compile=false", est_s=70),
            fast("gptoss_fast_mb2", "gpt-oss-20b --speed auto, mb 2 x ga 1", "--speed", "auto",
                 *mb2, mb=2, ga=1)]
    rows[1].role = "fast"
    if not smoke:   # transformers runs flex attention's sinks on CUDA only
        rows.append(fast("gptoss_fast_flex", "gpt-oss-20b --speed auto --attn flex_attention",
                         "--speed", "auto", "--attn", "flex_attention", est_s=170))
    return rows


def qlora_plan(smoke: bool, recipe, shape_of) -> list:
    """Axolotl's QLoRA recipe beside the TRL LoRA recipe's QLoRA mode on the same model, shape
    and adapter: OLMo-3-7B (the Axolotl seed's model, the one shape Axolotl has run on the
    lent GPU), random init, 2 x 2048 tokens, 4 micro-batches a step (the seed's mb 2 x ga 4),
    a 4-bit nf4 base, LoRA r 32 alpha 16 dropout 0.05 on all linear layers (the seed's).

    Both rows get the same explicit choices where a framework would otherwise decide alone:
    no gradient checkpointing (the step fits without it: 44 GiB at most on an H100, from
    Axolotl's own log of 2026-12-07), and tokens counted from the batches each optimizer step fetched
    (``-x token_counter=batches``, the same counter in both). Axolotl's row runs on its carried
    tree (``site="axolotl"``: its pinned transformers 5.16.1 / trl 1.9.0 / peft 0.20.0); the
    TRL row runs the TRL stack plus bitsandbytes alone (``site="trl_qlora"``, see
    bench/llm_speed.sh). On CPU (``--smoke``) both run the tiny OLMo-3: the TRL row quantizes
    for real (bitsandbytes 0.50.2 runs 4-bit on CPU); Axolotl's recipe trains plain LoRA there
    (it turns 4 bits on only on a GPU, and says so). The two variant rows (Liger, compiled
    layers: off by default over 4 bits, unmeasured) run on GPU only, with the budget's slack.

    The window: 24 steps, the first 6 skipped. On 2026-12-07 (H100) the TRL row ran 10 steps
    with 2 skipped, and two of its 8 measured steps stalled (steps 3 and 4: 3.07 s and 4.26 s
    against 2.22-2.37 s for steps 5-10); they alone made the ratio 0.87x, while its steps 5-10
    took 2.29 s for 16.3k tokens against Axolotl's 2.26 s for 16.2k (0.99x per step, the
    median-step ratio ``llm_speed.ratios`` now reports beside the mean). A longer window and
    more warm-up keep one stall from deciding the ratio."""
    group = "qlora"
    olmo = shape_of(smoke, "olmo-3-7b", 2048, 2, 4, 4 if smoke else QLORA_STEPS,
                    "--measure-after", "2" if smoke else str(QLORA_SKIP), "--eval-batches", "1",
                    "--lr", "2e-4", "--warmup-steps", "1")
    same = olmo + ["--lora-r", "32", "--lora-alpha", "16", "--lora-dropout", "0.05",
                   "--no-gradient-checkpointing", "-x", "token_counter=batches"]
    trl = same + ["--load-in-4bit", "-x", "save=false"]
    rows = [recipe("axolotl_qlora", group, "axolotl_qlora_ddp", same, role="framework",
                   site="axolotl", smoke=smoke, est_s=165,
                   row="axolotl_qlora_ddp OLMo-3-7B, 4-bit base, r 32 (Axolotl 0.19's trainer)"),
            recipe("trl_qlora", group, "trl_sft_lora_ddp", trl, role="framework_twin",
                   site="trl_qlora", smoke=smoke, est_s=125,
                   row="trl_sft_lora_ddp --load-in-4bit --speed auto, the same model, shape "
                       "and adapter")]
    if not smoke:   # the budget's slack: do Liger, or compiled layers, pay over Linear4bit?
        rows += [recipe("trl_qlora_liger", group, "trl_sft_lora_ddp", trl + ["-x", "liger=true"],
                        role="variant", site="trl_qlora", smoke=smoke, est_s=125,
                        row="trl_sft_lora_ddp --load-in-4bit -x liger=true (Liger's kernels "
                            "over a 4-bit base)"),
                 recipe("trl_qlora_compiled", group, "trl_sft_lora_ddp",
                        trl + ["-x", "compile=true"], role="variant", site="trl_qlora",
                        smoke=smoke, est_s=155,
                        row="trl_sft_lora_ddp --load-in-4bit -x compile=true (compiled "
                            "layers over Linear4bit)")]
    return rows


def foundry_plan(smoke: bool, recipe, shape_of) -> list:
    """LLM Foundry's full fine-tune (recipes/llmfoundry_fsdp.py: Composer's trainer, amp_bf16,
    decoupled LionW) beside the TRL full fine-tuning recipe as plain DDP (``trl_sft_full_zero3
    -x technique=ddp``: one process, where ZeRO-3 shards nothing) on the ``full`` group's shape:
    Llama-3.2-1B, random init, world size 1, 4 x 2048 tokens a step (``--data long``; Foundry's
    global batch 4 at micro-batch 4), 40 steps, no gradient checkpointing in either. At world
    size 1 Foundry itself drops the FSDP config ("FSDP is not applicable for single-GPU
    training. Reverting to DDP.") and Composer trains the bare model: the row reports wrapper
    ``single``; FSDP needs 2 ranks or more. Tokens: Foundry's probe counts the real
    (attention-mask) tokens of each step's batch; the TRL row counts the same (``-x
    token_counter=batches``). Foundry runs on its carried tree (``site="foundry"``:
    bench/llm_foundry_bundle.sh, transformers 4.51.3 beside the machine's torch). On CPU
    (``--smoke``) both run the tiny Llama, one rank."""
    group = "foundry"
    steps = 4 if smoke else 40
    one_b = shape_of(smoke, "llama-3.2-1b", 2048, 4, 1, steps, "--measure-after", "8",
                     "--eval-batches", "2", "--lr", "2e-4", "--warmup-steps", "2") + [
        "-x", "save=false", "--no-gradient-checkpointing"]
    return [recipe("foundry_1b", group, "llmfoundry_fsdp",
                   one_b + ["-x", f"global_batch={2 if smoke else 4}"], role="framework",
                   site="foundry", smoke=smoke, est_s=150,
                   row="llmfoundry_fsdp Llama-3.2-1B full (Composer's trainer, llm-foundry "
                       "0.22.0 carried beside the machine's torch; 1 rank: no FSDP wrap)"),
            recipe("trl_full_1b", group, "trl_sft_full_zero3",
                   one_b + ["-x", "technique=ddp", "-x", "token_counter=batches"],
                   role="framework_twin", smoke=smoke, est_s=70,
                   row="trl_sft_full_zero3 --speed auto -x technique=ddp, the same shape")]
