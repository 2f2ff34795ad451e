#!/usr/bin/env bash
# The three TRL recipes on one GPU, launched by gpulaunch, at a real model shape (Llama-3.2-1B,
# random init, bf16): LoRA under DDP, LoRA under FSDP2 (world size 1, so FSDP is really on and
# checked), full fine-tune under ZeRO-3 (export checked against the gathered shards). Then, if
# time is left, gpt-oss-20b (the seed's real shape, 20.9B parameters) LoRA under DDP.
#
# Writes under $OUT (default ./out-llm; at most 8 files come back from the device): <run>.log
# per run, and summary.json: versions, plus each run's rank-0 result (eval loss before/after,
# tokens/s, peak memory, technique and wrapper in effect, ZeRO-3 export check).
#
# On the lent H200 (Python 3.12, torch 2.11, no network) carry the wheels built by
#   bash bench/llm_recipes_gpu_wheels.sh      # -> .whl/ (~21 MiB)
# and run:  bash bench/llm_recipes_gpu.sh        (SMOKE=1: the same on CPU, tiny, to check the script)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out-llm}
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import trl, deepspeed" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD/recipes${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export GPULAUNCH_HOME=/tmp/gpulaunch-home TORCH_EXTENSIONS_DIR=/tmp/torch-ext
RES=/tmp/llm-results; rm -rf "$RES"; mkdir -p "$RES"
python3 - <<'EOF' 2>&1 | tee "$RES/versions.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for m in ("transformers", "trl", "peft", "accelerate", "datasets", "deepspeed", "pyarrow", "fsspec"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, "MISSING", type(e).__name__, e)
EOF
start=$(date +%s)
COMMON=(--arch llama-3.2-1b --full --gpus 1 --max-steps 40 --seq-len 1024 --eval-steps 20
        --logging-steps 10 --eval-batches 8 --report-to none)
FSDP_EXTRA=()
big_budget=300          # seconds: start the gpt-oss-20b run only before this
total=420               # seconds for the runs (the device allows 600 per command, install included)
if [ -n "${SMOKE:-}" ]; then   # CPU check of this script: tiny model, 1 CPU rank, 4 steps
  export GPULAUNCH_FORCE_CPU=1
  COMMON=(--arch llama-3.2-1b --gpus 1 --max-steps 4 --seq-len 64 --eval-steps 2
          --logging-steps 2 --eval-batches 2 --report-to none)
  FSDP_EXTRA=(-x on_cpu=ddp); big_budget=0; total=3000
fi
run() {  # label, recipe, args...
  local label=$1 recipe=$2; shift 2
  local limit=$(( total - ($(date +%s) - start) ))
  [ -z "${SMOKE:-}" ] && [ $limit -gt 240 ] && limit=240
  echo "=== $label: $recipe $* (at $(( $(date +%s) - start )) s, limit $limit s)"
  local launcher=(python3)
  [ -n "${TORCHRUN:-}" ] && launcher=(python3 -m torch.distributed.run --nproc-per-node 1)
  timeout $limit "${launcher[@]}" "recipes/$recipe.py" --results "$RES/$label.json" \
    --output "/tmp/llm-out/$label" "$@" > "$OUT/$label.log" 2>&1
  echo "exit $? at $(( $(date +%s) - start )) s"; tail -20 "$OUT/$label.log"
  rm -rf "/tmp/llm-out/$label"
}
# DDP and FSDP2 with the same LoRA settings, data and seed: their losses are compared below
LORA=(--batch-size 4 --grad-accum 2 --lr 2e-4 --scheduler cosine --warmup-steps 0.03
      --lora-r 8 --lora-alpha 16 --lora-dropout 0 --gradient-checkpointing)
run trl_sft_lora_ddp   trl_sft_lora_ddp   "${COMMON[@]}" "${LORA[@]}"
run trl_sft_lora_fsdp  trl_sft_lora_fsdp  "${COMMON[@]}" "${LORA[@]}" "${FSDP_EXTRA[@]}"
run trl_sft_full_zero3 trl_sft_full_zero3 "${COMMON[@]}" --batch-size 2 --lr 2e-4
# the same script under torchrun instead of gpulaunch (parity expected)
TORCHRUN=1 run torchrun_lora_ddp trl_sft_lora_ddp "${COMMON[@]}" "${LORA[@]}"
if [ $(( $(date +%s) - start )) -lt $big_budget ]; then   # the seed's real shape, if time is left
  run gpt_oss_20b_lora_ddp trl_sft_lora_ddp --arch gpt-oss-20b --full --gpus 1 --max-steps 10 \
    --seq-len 1024 --eval-steps 10 --eval-batches 4 --batch-size 1 --grad-accum 2 \
    --gradient-checkpointing --attn eager --report-to none -x save=false
fi
python3 - "$RES" "$OUT" <<'EOF'
import json, sys, pathlib
res, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
summary = {"versions": (res / "versions.txt").read_text().splitlines(), "runs": {}}
for f in sorted(res.glob("*.json")):
    summary["runs"][f.stem] = json.loads(f.read_text())
(out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
keys = ("technique", "wrapper", "world_size", "precision", "parameters", "trainable_parameters",
        "eval_loss_before", "eval_loss_after", "tokens_per_second", "peak_memory_gib", "steps")
for name, r in summary["runs"].items():
    print(name, {k: r.get(k) for k in keys}, "export_ok" if (r.get("export_check") or {}).get("ok") else "")
a, b = summary["runs"].get("trl_sft_lora_ddp"), summary["runs"].get("trl_sft_lora_fsdp")
if a and b:
    rel = [abs(x[1] - y[1]) / abs(y[1]) for x, y in zip(a["eval_losses"], b["eval_losses"])]
    summary["ddp_vs_fsdp2_eval_loss_rel_diff"] = rel
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print("DDP vs FSDP2 eval loss, relative difference per eval:", [f"{v:.2e}" for v in rel])
t, g = summary["runs"].get("torchrun_lora_ddp"), summary["runs"].get("trl_sft_lora_ddp")
if t and g:
    summary["torchrun_vs_gpulaunch"] = {
        "tokens_per_second": [t["tokens_per_second"], g["tokens_per_second"]],
        "peak_memory_gib": [t["peak_memory_gib"], g["peak_memory_gib"]],
        "eval_losses": [t["eval_losses"], g["eval_losses"]]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print("torchrun vs gpulaunch (same script):", summary["torchrun_vs_gpulaunch"])
EOF
