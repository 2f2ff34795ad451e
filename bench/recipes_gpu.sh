#!/usr/bin/env bash
# Every recipe of recipes/ at its GPU (--full) settings on the GPUs of this host, one after the
# other; for the lent H200 (one GPU) it takes about 5 minutes. Writes under $OUT (or ./out):
#   recipes.log                     everything printed, in order
#   <recipe>.json                   each recipe's result dict (metric before/after, throughput,
#                                   peak GPU memory, loss history, config)
#   pytorch_transformer_fsdp_resume.json   the second transformer run, resumed from a checkpoint
# Needs torch + torchvision, lightning, torchmetrics, pandas, cloudpickle, psutil, and pycocotools
# for RetinaNet (carry its wheel: see recipes/README.md). mlflow is optional.
#
#   PYTHONPATH=src bash bench/recipes_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
work="$(mktemp -d /tmp/gpulaunch-recipes-XXXX)"   # data, checkpoints: fresh every time
export PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
log="$out/recipes.log"
: > "$log"
status=0

step() {  # name, then the command; the log gets a header and the wall time of each
  local name="$1"; shift
  echo "=== $name: $*" | tee -a "$log"
  local t0=$SECONDS
  ( cd "$work" && "$@" ) 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
  [ "$rc" = 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
"$py" -c "import torch, torchvision, lightning, torchmetrics; print('torch', torch.__version__, \
'torchvision', torchvision.__version__, 'lightning', lightning.__version__, 'torchmetrics', \
torchmetrics.__version__)" 2>&1 | tee -a "$log"

r="$PWD/recipes"
if [ "${SMOKE:-0}" = 1 ]; then  # the same script at the tiny settings, to try it on a CPU
  full=(); steps1=(--steps 10 --dim 128 --blocks 2); steps2=(--steps 20 --dim 128 --blocks 2)
else
  full=(--full); steps1=(--steps 1000); steps2=()
fi
step quickstart "$py" "$r/quickstart.py"
step pytorch_mlp_ddp "$py" "$r/pytorch_mlp_ddp.py" "${full[@]}" --out "$out/pytorch_mlp_ddp.json"
# the transformer twice: 1000 steps, then the same command to 1500 resumes at step 1000
step pytorch_transformer_fsdp "$py" "$r/pytorch_transformer_fsdp.py" "${full[@]}" \
  "${steps1[@]}" --ckpt-dir "$work/ckpt" --out "$out/pytorch_transformer_fsdp.json"
step pytorch_transformer_fsdp_resume "$py" "$r/pytorch_transformer_fsdp.py" "${full[@]}" \
  "${steps2[@]}" --ckpt-dir "$work/ckpt" --out "$out/pytorch_transformer_fsdp_resume.json"
step lightning_two_tower_ddp "$py" "$r/lightning_two_tower_ddp.py" "${full[@]}" \
  --out "$out/lightning_two_tower_ddp.json"
# RetinaNet last, with a training-time cap so the whole script stays within ~6 minutes
step pytorch_retinanet_ddp "$py" "$r/pytorch_retinanet_ddp.py" "${full[@]}" \
  --max-train-seconds "${RETINANET_SECONDS:-120}" --out "$out/pytorch_retinanet_ddp.json"

"$py" - "$out" <<'EOF' 2>&1 | tee -a "$log"
import json, pathlib, sys
print(f"{'recipe':34} {'metric':10} {'before':>8} {'after':>8} {'samples/s':>10} {'peak GiB':>9}")
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    sps = r.get("samples_per_s")
    print(f"{f.stem:34} {r['metric']:10} {r['before']:8.4f} {r['after']:8.4f} "
          f"{sps if sps is None else round(sps):>10} {r['peak_mem_gib']:9.2f}")
EOF
rm -rf "$work"
exit $status
