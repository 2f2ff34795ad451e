#!/usr/bin/env bash
# The three TRL recipes on one GPU, launched by gpulaunch, at a real model shape (Llama-3.2-1B,
# random init, bf16): LoRA under DDP, LoRA under FSDP2 (world size 1, so FSDP is really on and
# checked), full fine-tune under ZeRO-3 (export checked against the gathered shards). Then, if
# time is left, gpt-oss-20b (the seed's real shape, 20.9B parameters) LoRA under DDP.
#
# Writes under $OUT (default ./out-llm): <recipe>.json (rank-0 result: eval loss before/after,
# tokens/s, peak memory, technique and wrapper in effect), <recipe>.log, summary.json.
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
python3 - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
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
big_budget=280          # seconds: start the gpt-oss-20b run only before this
if [ -n "${SMOKE:-}" ]; then   # CPU check of this script: tiny model, 1 CPU rank, 4 steps
  export GPULAUNCH_FORCE_CPU=1
  COMMON=(--arch llama-3.2-1b --gpus 1 --max-steps 4 --seq-len 64 --eval-steps 2
          --logging-steps 2 --eval-batches 2 --report-to none)
  FSDP_EXTRA=(-x on_cpu=ddp); big_budget=0
fi
run() {  # name, args...
  local name=$1; shift
  echo "=== $name $* ($(( $(date +%s) - start )) s)"
  timeout 240 python3 "recipes/$name.py" --results "$OUT/$name.json" --output "/tmp/llm-out/$name" \
    "$@" > "$OUT/$name.log" 2>&1
  echo "exit $? after $(( $(date +%s) - start )) s"; tail -22 "$OUT/$name.log"
}
run trl_sft_lora_ddp   "${COMMON[@]}" --batch-size 4 --lr 2e-4
run trl_sft_lora_fsdp  "${COMMON[@]}" --batch-size 4 --lr 1.5e-4 "${FSDP_EXTRA[@]}"
run trl_sft_full_zero3 "${COMMON[@]}" --batch-size 2 --lr 2e-4
rm -rf /tmp/llm-out
if [ $(( $(date +%s) - start )) -lt $big_budget ]; then   # the seed's real shape, if time is left
  run trl_sft_lora_ddp --arch gpt-oss-20b --full --gpus 1 --max-steps 10 --seq-len 1024 \
    --eval-steps 10 --eval-batches 4 --batch-size 1 --grad-accum 2 --gradient-checkpointing \
    --attn eager --report-to none -x save=false --results "$OUT/gpt_oss_20b_lora_ddp.json"
fi
python3 - "$OUT" <<'EOF'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1]); rows = {}
for f in sorted(out.glob("*.json")):
    if f.name == "summary.json": continue
    r = json.loads(f.read_text())
    rows[f.stem] = {k: r.get(k) for k in ("technique", "wrapper", "world_size", "precision",
        "parameters", "trainable_parameters", "eval_loss_before", "eval_loss_after",
        "tokens_per_second", "peak_memory_gib", "step_seconds", "steps", "export_check")}
(out / "summary.json").write_text(json.dumps(rows, indent=2, default=str))
print(json.dumps(rows, indent=2, default=str))
EOF
