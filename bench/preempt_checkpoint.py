"""Time from a preemption notice to its checkpoint, and to the caller's exit.

A caller process runs ``.distributed()`` (DDP over gloo on CPU, NCCL on GPUs) with
``preempt_grace=``; the training loop calls ``parallel.save_on_preemption`` every step. Once
the run has trained a few steps, the benchmark sends SIGTERM to the caller (what Kubernetes
does; Slurm's ``--signal=B:USR1@N`` is the same path with SIGUSR1) and reads back:

* notice -> checkpoint published: the notice's time (written by the caller's signal handler)
  to the moment rank 0 recorded the complete checkpoint (``attempt0/preempted.json``);
* SIGTERM -> caller exited: what a scheduler's grace period must cover;
* the resumed start: a second caller resumes from that checkpoint (its first step is checked).

    python bench/preempt_checkpoint.py --params-m 20 --reps 3 --out /tmp/preempt
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TRAIN = '''
import os, sys, time, torch
from gpulaunch import distributed, runtime as rt
from gpulaunch.parallel import prepare, resume, save_on_preemption


def train(ckpt, steps, dim, layers, device_steps_file):
    device = rt.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)]).to(device)
    p = prepare(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), strategy="ddp")
    step = start = resume(ckpt, p)
    while step < steps:
        x = torch.randn(8, dim, device=device)
        p.backward(p.model(x).pow(2).mean()); p.step(); p.zero_grad()
        step += 1
        if rt.get_global_rank() == 0:
            with open(device_steps_file, "a") as f:
                f.write(f"{{step}}\\n")
        save_on_preemption(ckpt, p, step=step)
    return start


if __name__ == "__main__":
    starts = distributed(gpus={ranks}, preempt_grace={grace})(train).distributed(
        {ckpt!r}, int(sys.argv[1]), {dim}, {layers}, {progress!r})
    print("START", starts[0], flush=True)
'''


def _wait_lines(path: Path, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().split()) >= n:
            return
        time.sleep(0.02)
    raise SystemExit(f"the run did not reach step {n} within {timeout:g} s")


def one(args, work: Path, rep: int) -> dict:
    home = work / f"home{rep}"
    ckpt, progress = work / f"ckpt{rep}", work / f"progress{rep}"
    dim = max(16, int((args.params_m * 1e6 / args.layers) ** 0.5))
    script = work / f"train{rep}.py"
    script.write_text(textwrap.dedent(TRAIN.format(
        ranks=args.ranks, grace=args.grace, ckpt=str(ckpt), dim=dim,
        layers=args.layers, progress=str(progress))))
    env = {**os.environ, "GPULAUNCH_HOME": str(home), "GPULAUNCH_TRACKING": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    caller = subprocess.Popen([sys.executable, str(script), "1000000"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    _wait_lines(progress, args.signal_at, 600)
    sent = time.time()
    caller.send_signal(signal.SIGTERM)
    out, _ = caller.communicate(timeout=args.grace + 120)
    exited = time.time()
    run = sorted((home / "runs").iterdir())[-1]
    saved = json.loads((run / "attempt0" / "preempted.json").read_text())
    agent_ended = json.loads((run / "status.json").read_text()).get("ended") or 0.0
    size = sum(f.stat().st_size for f in Path(saved["checkpoint"]).rglob("*") if f.is_file())
    resumed = subprocess.run([sys.executable, str(script), str(saved["step"] + 2)], env=env,
                             capture_output=True, text=True, timeout=900)
    start = next((int(line.split()[1]) for line in resumed.stdout.splitlines()
                  if line.startswith("START")), None)
    return {"params_m": round(dim * dim * args.layers / 1e6, 2), "checkpoint_mib": size / 2**20,
            "caller_exit_code": caller.returncode, "step_saved": saved["step"],
            "notice_to_checkpoint_s": saved["saved_at"] - saved["notice"]["received_at"],
            "sigterm_to_notice_s": saved["notice"]["received_at"] - sent,
            "sigterm_to_agent_end_s": agent_ended - sent,
            "sigterm_to_caller_exit_s": exited - sent,
            "resumed_at_step": start, "resumed_ok": resumed.returncode == 0,
            "caller_message": next((line for line in out.splitlines()
                                    if line.startswith("gpulaunch.errors.PreemptedError")), "")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params-m", type=float, default=20.0, help="model size, M parameters")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("--signal-at", type=int, default=5, help="SIGTERM after this many steps")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="preempt-bench-") as tmp:
        for rep in range(args.reps):
            row = one(args, Path(tmp), rep)
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {"args": vars(args), "load_average": os.getloadavg(), "results": rows,
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out / "preempt_checkpoint.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
