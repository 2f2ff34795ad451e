#!/usr/bin/env bash
# The GPU test suite (tests/gpu) in one command, for the lent GPU machine (docs/gpu.md).
#
#   bash scripts/gpu_suite.sh                 # there, from the repo root, with .whl/ carried
#   GPU_SUITE_DRY=1 bash scripts/gpu_suite.sh # anywhere: collect, and show every test skip
#                                             # with its reason on a host without a GPU
#
# 1. installs the carried wheels (.whl/, built here by scripts/gpu_wheels.sh) into /tmp/site,
#    unless the same set is there already (a warm machine keeps /tmp), and checks on this
#    machine that every requirement of what it installed is met (warnings, not a stop);
# 2. runs `pytest tests/gpu -m gpu` with a per-test timeout, the whole run capped at
#    GPU_SUITE_BUDGET seconds (SIGINT, so junit and the records are still written);
# 3. stops any process the suite left (found by a tag in its environment, ended by pid) and
#    reports GPU processes still there;
# 4. writes under $OUT (at most 7 files): gpu-summary.txt (date, host, GPU, driver, versions,
#    pass/fail of every test, wall times), gpu-junit.xml, gpu-pytest.log, gpu-results.jsonl
#    (one line per test as it finished), gpu-records.json (losses, timings), gpu-launch-times.json
#    (first/second/third call to the first NCCL collective), gpu-artifacts.tar.gz (logs of
#    failed tests' runs, if any).
set -uo pipefail
cd "$(dirname "$0")/.."
T_START=$(date +%s)
OUT=${OUT:-$PWD/gpu-suite-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DRY=${GPU_SUITE_DRY:-0}
SITE=${GPU_SUITE_SITE:-/tmp/site}
BUDGET=${GPU_SUITE_BUDGET:-420}         # seconds for pytest; the device call allows 600
PER_TEST=${GPU_SUITE_TEST_TIMEOUT:-150} # default per test (tests set their own, most of them)
rm -f "$OUT"/gpu-results.jsonl "$OUT"/gpu-records.json "$OUT"/gpu-launch-times.json \
  "$OUT"/gpu-artifacts.tar.gz
say() { echo "gpu_suite: $*"; }

# ------------------------------------------------------------------ 1. carried wheels
WHEELS="skipped (GPU_SUITE_DRY)"
if [ "$DRY" != 1 ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    stamp=$(ls -l .whl/*.whl | awk '{print $5, $NF}' | sha256sum | cut -c1-16)
    if [ "$(cat "$SITE/.gpu-suite-stamp" 2>/dev/null)" = "$stamp" ]; then
      WHEELS="already in $SITE ($(ls .whl/*.whl | wc -l) wheels, same set)"
    else
      t0=$(date +%s)
      if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target "$SITE" .whl/*.whl; then
        echo "$stamp" > "$SITE/.gpu-suite-stamp"
        WHEELS="installed $(ls .whl/*.whl | wc -l) wheels into $SITE in $(( $(date +%s) - t0 )) s"
      else
        WHEELS="INSTALL FAILED (pip exit $?): tests needing those packages will fail and say so"
      fi
    fi
  else
    WHEELS="NONE CARRIED (.whl/ is empty or absent): tests needing trl, datasets, deepspeed, mlflow, pycocotools will fail and say so"
  fi
fi
say "wheels: $WHEELS"
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" != 1 ] && [ -d "$SITE" ]; then   # what pip --no-deps did not check
  "$PY" - "$SITE" <<'EOF' 2>&1 | tee "$OUT/.requirements.txt"
import importlib.metadata as md, os, sys
from packaging.requirements import Requirement
site = os.path.realpath(sys.argv[1])
have = {}
for d in md.distributions():
    have.setdefault(d.metadata["Name"].lower().replace("_", "-"), d.version)
bad = []
for d in md.distributions(path=[site]):
    for raw in d.requires or []:
        r = Requirement(raw)
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        v = have.get(r.name.lower().replace("_", "-"))
        if v is None or not r.specifier.contains(v, prereleases=True):
            bad.append(f"{d.metadata['Name']} {d.version} needs {r.name}{r.specifier}: "
                       f"{'missing' if v is None else v}")
print("gpu_suite: requirements of the carried wheels:", "all met" if not bad else "")
for b in sorted(set(bad)):
    print("  UNMET", b)
EOF
fi

# ------------------------------------------------------------------ 2. the suite
export GPU_SUITE_OUT="$OUT" GPU_SUITE_TAG="gpu-suite-$$-$T_START"
export GPU_SUITE_ARTIFACTS; GPU_SUITE_ARTIFACTS=$(mktemp -d /tmp/gpu-suite-artifacts-XXXX)
export PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/gpu-suite-torch-ext}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset GPULAUNCH_FORCE_CPU
args=(tests/gpu -m gpu -p no:cacheprovider -rA --junitxml="$OUT/gpu-junit.xml")
# The LLM recipes' GPU tests need their own wheels (bench/llm_recipes_gpu_wheels.sh) and minutes:
# they run in the LLM device call (bench/llm_recipes_gpu.sh) unless GPU_SUITE_LLM=1.
[ "${GPU_SUITE_LLM:-0}" = 1 ] || args+=(--ignore=tests/gpu/test_llm_recipes_gpu.py)
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
  args+=(--timeout="$PER_TEST")
else
  say "pytest-timeout is not installed: no per-test timeout, only the ${BUDGET} s cap"
fi
if [ "$DRY" = 1 ]; then
  say "dry run: what is collected"
  "$PY" -m pytest tests/gpu -m gpu -p no:cacheprovider --collect-only -q 2>&1 | tee "$OUT/gpu-pytest.log"
fi
T_TESTS=$(date +%s)
export GPU_SUITE_DEADLINE=$((T_TESTS + BUDGET))   # the recipes finish (or fail) before the cap
# conftest writes what it collected here: the summary lists those that never ran
export GPU_SUITE_COLLECTED=$(mktemp /tmp/gpu-suite-collected.XXXXXX)
timeout -s INT -k 30 "$BUDGET" "$PY" -m pytest "${args[@]}" 2>&1 | tee -a "$OUT/gpu-pytest.log"
RC=${PIPESTATUS[0]}
T_END=$(date +%s)
[ "$RC" = 124 ] && say "pytest stopped at the ${BUDGET} s cap (GPU_SUITE_BUDGET)"

# ------------------------------------------------------------------ 3. nothing left running
LEFT=""
for env in /proc/[0-9]*/environ; do
  pid=${env#/proc/}; pid=${pid%/environ}
  [ "$pid" = $$ ] && continue
  if tr '\0' '\n' 2>/dev/null < "$env" | grep -qx "GPU_SUITE_TAG=$GPU_SUITE_TAG"; then
    LEFT="$LEFT $pid($(tr '\0' ' ' 2>/dev/null < "/proc/$pid/cmdline" | cut -c1-60))"
    kill -KILL "$pid" 2>/dev/null
  fi
done
[ -n "$LEFT" ] && say "killed processes the suite left:$LEFT"
export GPU_SUITE_LEFT="${LEFT:-none}"
rm -rf "$GPU_SUITE_ARTIFACTS"

# ------------------------------------------------------------------ 4. the summary
export GPU_SUITE_WHEELS="$WHEELS" GPU_SUITE_RC="$RC" GPU_SUITE_SITE="$SITE" GPU_SUITE_SCRIPTS="$PWD/scripts"
export GPU_SUITE_SECONDS="total $((T_END - T_START)) s (setup $((T_TESTS - T_START)) s, pytest $((T_END - T_TESTS)) s)"
"$PY" - "$OUT" <<'EOF'
import datetime, importlib, json, os, platform, socket, subprocess, sys
from pathlib import Path
out = Path(sys.argv[1])
site = os.path.realpath(os.environ.get("GPU_SUITE_SITE", "/tmp/site"))
lines = [f"gpulaunch GPU suite: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
         f"host: {socket.gethostname()}, {platform.platform()}, {os.cpu_count()} CPUs, "
         f"Python {platform.python_version()}"]
def run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001 - no nvidia-smi, no git: said as "none"/"unknown"
        return ""
smi = run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
           "--format=csv,noheader"])
lines.append("GPUs: " + ("; ".join(smi.splitlines()) if smi else "none (nvidia-smi absent)"))
commit = run(["git", "rev-parse", "--short", "HEAD"]) or "unknown (no .git here)"
# A copied working tree (the device tool's) can sit on another commit's .git: say how far the
# files are from that commit, so the line never passes a tree off as a commit it is not.
changed = run(["git", "status", "--porcelain", "--untracked-files=no"])
if changed:
    commit += f" + {len(changed.splitlines())} changed tracked files (not that commit)"
lines.append(f"gpulaunch checkout: {commit}")
lines.append(f"carried wheels: {os.environ.get('GPU_SUITE_WHEELS')}")
req = out / ".requirements.txt"
if req.exists():
    lines += [l for l in req.read_text().splitlines() if "UNMET" in l]
    req.unlink()
import importlib.metadata as md
DIST = {"pynvml": "nvidia-ml-py"}
vers = []
for mod in ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "deepspeed",
            "mlflow", "lightning", "torchvision", "torchmetrics", "pycocotools", "triton",
            "numpy", "pynvml"):
    try:
        m = importlib.import_module(mod)
        where = "carried" if os.path.realpath(getattr(m, "__file__", "") or "").startswith(site) \
            else "image"
        try:
            v = md.version(DIST.get(mod, mod))
        except md.PackageNotFoundError:
            v = getattr(m, "__version__", "?")
        vers.append(f"{mod} {v} ({where})")
    except Exception as e:  # noqa: BLE001
        vers.append(f"{mod} MISSING ({type(e).__name__})")
try:
    import torch
    vers.insert(1, f"CUDA {torch.version.cuda}")
    if torch.cuda.is_available():
        vers.insert(2, "NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
except Exception:  # noqa: BLE001
    pass
lines.append("versions: " + ", ".join(vers))
sys.path.insert(0, os.environ["GPU_SUITE_SCRIPTS"])
from gpu_suite_rows import rows as suite_rows
rows, note = suite_rows(out / "gpu-junit.xml", out / "gpu-results.jsonl",
                        Path(os.environ["GPU_SUITE_COLLECTED"]))
if note:
    lines.append(note)
counts = {}
for status, *_ in rows:
    counts[status] = counts.get(status, 0) + 1
lines.append("result: " + (", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no test ran")
             + f"; pytest exit {os.environ.get('GPU_SUITE_RC')}; {os.environ.get('GPU_SUITE_SECONDS')}")
lines.append("")
lines += [f"{s:8} {t:7.1f}s  {n}" + (f"\n{'':18}{m}" if m and s != "passed" else "")
          for s, t, n, m in rows]
launch = out / "gpu-launch-times.json"
if launch.exists():
    lt = json.loads(launch.read_text())
    lines.append("")
    lines.append(f"launch times ({lt.get('gpus')} x {lt.get('gpu')}; caller import torch "
                 f"{lt.get('caller_import_torch_s')} s):")
    for label, c in lt.get("calls", {}).items():
        lines.append(f"  {label:6} call: first collective {c['to_first_collective_s']} s, "
                     f"process group {c['to_process_group_s']} s, function {c['to_function_s']} s, "
                     f"whole call {c['whole_s']} s (idle before: {c['idle_before_s']} s)")
apps = run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"])
lines.append("")
lines.append(f"left running by the suite (killed): {os.environ.get('GPU_SUITE_LEFT')}")
lines.append("GPU processes after the suite: " + (apps.replace("\n", "; ") if apps else "none"))
text = "\n".join(lines) + "\n"
(out / "gpu-summary.txt").write_text(text)
print("\n" + text)
EOF
rm -f "$GPU_SUITE_COLLECTED"
say "outputs in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit "$RC"
