"""Where a recipe's training step spends its time: ``torch.profiler`` over a few optimizer
steps of the real Trainer, asked for with ``-x profile=START:COUNT`` (for example
``-x profile=12:3``: steps 12, 13 and 14, counted from 0, after compilation and warm-up).

Written to ``-x profile_dir=DIR`` (default: ``<output>/profile``), by rank 0 only:

- ``steps.md``: each profiled step's wall time, the GPU's busy time in it (kernels and copies,
  overlaps merged), the host-to-device synchronisations the step waited on, the kernels with
  the most GPU time and the host ops with the most CPU time;
- ``trace.json.gz``: the Chrome trace (open it in Perfetto).

``-x profile_stack=true`` records Python stacks too (a larger trace), and ``steps.md`` then
names the Python frames the host waited on the GPU in (each ``item()`` and CUDA sync).

Profiled steps are slower than the others (the profiler records every op): the bench profiles
separate, shorter runs, never the runs whose tokens/s it reports.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import time
from pathlib import Path

STEP_SPAN = "llm_common::step#"


def parse_spec(spec) -> tuple[int, int]:
    """``"START:COUNT"`` (or ``"START"``, 3 steps) to ``(start, count)``; a clear error otherwise."""
    text = str(spec)
    try:
        start, _, count = text.partition(":")
        start, count = int(start), int(count or 3)
    except ValueError:
        raise SystemExit(f"-x profile={text!r}: use START:COUNT, e.g. -x profile=12:3") from None
    if start < 0 or count < 1:
        raise SystemExit(f"-x profile={text!r}: START >= 0 and COUNT >= 1, e.g. -x profile=12:3")
    return start, count


def busy_ms(events: list[dict], lo: float, hi: float) -> float:
    """Milliseconds of [lo, hi] (trace microseconds) covered by at least one GPU event."""
    spans = sorted((max(e["ts"], lo), min(e["ts"] + e.get("dur", 0), hi)) for e in events
                   if e["ts"] < hi and e["ts"] + e.get("dur", 0) > lo)
    total, end = 0.0, lo
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def trace_summary(trace: dict) -> list[dict]:
    """Per profiled step (the ``llm_common::step#N`` spans): wall ms, GPU busy ms, and the host
    syncs inside it (``cudaStreamSynchronize``/``cudaDeviceSynchronize``/``cudaEventSynchronize``
    and ``aten::item``/``aten::_local_scalar_dense``: each one lets the GPU run dry)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = sorted((e for e in ev if e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith(STEP_SPAN)),
                   key=lambda e: e["ts"])
    out = []
    for s in steps:
        lo, hi = s["ts"], s["ts"] + s["dur"]
        inside = [e for e in ev if lo <= e["ts"] < hi]
        syncs = [e for e in inside if e.get("name") in (
            "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")]
        out.append({"step": s["name"], "wall_ms": s["dur"] / 1e3, "gpu_busy_ms": busy_ms(gpu, lo, hi),
                    "syncs": len(syncs), "sync_wait_ms": sum(e["dur"] for e in syncs) / 1e3,
                    "item_calls": sum(e.get("name") in ("aten::item", "aten::_local_scalar_dense")
                                      for e in inside)})
    return out


def sync_sources(trace: dict, top: int = 15) -> list[tuple[str, int]]:
    """Where the host waited on the device: for each ``aten::item`` (and each CUDA sync call),
    the innermost Python frame around it that is not torch's own (the trace must have stacks:
    ``-x profile_stack=true``). [(frame, count)], most first."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    frames = sorted((e for e in ev if e.get("cat") == "python_function"
                     and not re.match(r"(.*/)?torch/", str(e.get("name", "")))
                     and not str(e.get("name", "")).startswith("<built-in")),
                    key=lambda e: (e.get("tid"), e["ts"], -e.get("dur", 0)))
    by_tid: dict = {}
    for f in frames:
        by_tid.setdefault(f.get("tid"), []).append(f)
    counts: dict[str, int] = {}
    for e in ev:
        if e.get("name") not in ("aten::item", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                                 "cudaEventSynchronize"):
            continue
        around = [f for f in by_tid.get(e.get("tid"), ())
                  if f["ts"] <= e["ts"] and e["ts"] + e.get("dur", 0) <= f["ts"] + f.get("dur", 0)]
        name = min(around, key=lambda f: f.get("dur", 0))["name"] if around else "(no Python frame)"
        counts[name] = counts.get(name, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])[:top]


def _frame_index(trace: dict):
    """Per thread, the Python frames sorted by start: all of them, and those outside torch."""
    import bisect
    every: dict = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "python_function":
            every.setdefault(e.get("tid"), []).append(e)
    index = {}
    for tid, frames in every.items():
        frames.sort(key=lambda e: e["ts"])
        ours = [f for f in frames if not re.match(r"(.*/)?torch/", str(f.get("name", "")))
                and not str(f.get("name", "")).startswith("<built-in")]
        index[tid] = ((frames, [f["ts"] for f in frames]), (ours, [f["ts"] for f in ours]))

    def innermost(frames_starts, t):
        frames, starts = frames_starts
        i = bisect.bisect_right(starts, t) - 1
        for j in range(i, max(i - 4000, -1), -1):       # nested: the first that holds t
            f = frames[j]
            if f["ts"] + f.get("dur", 0) >= t:
                return f
        return None

    def at(t):
        """The innermost frame outside torch of the thread that entered a frame last before t."""
        best, best_start = None, None
        for every_t, ours_t in index.values():
            f = innermost(every_t, t)
            if f is not None and (best_start is None or f["ts"] > best_start):
                best, best_start = innermost(ours_t, t), f["ts"]
        return best["name"] if best else "(no Python frame)"
    return at


def idle_by_host_frame(trace: dict, top: int = 15, sample_us: float = 10.0) -> dict:
    """While the GPU had nothing to run inside the profiled steps, what was the host running?
    GPU-idle gaps (no kernel, copy or memset), sampled every ``sample_us``: each sample goes to
    the innermost Python frame outside torch of the thread most recently busy (the main thread,
    or autograd's during backward). Needs stacks (``-x profile_stack=true``)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted(((e["ts"], e["ts"] + e.get("dur", 0)) for e in ev
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")))
    steps = [e for e in ev if e.get("cat") == "user_annotation"
             and str(e.get("name", "")).startswith(STEP_SPAN)]
    at = _frame_index(trace)
    ms: dict[str, float] = {}
    idle = 0.0
    for s in steps:
        lo, hi = s["ts"], s["ts"] + s["dur"]
        cursor, gaps = lo, []
        for a, b in gpu:
            if b <= lo or a >= hi:
                continue
            if a > cursor:
                gaps.append((cursor, a))
            cursor = max(cursor, b)
        if cursor < hi:
            gaps.append((cursor, hi))
        for a, b in gaps:
            idle += b - a
            t = a + sample_us / 2
            while t < b:
                name = at(t)
                ms[name] = ms.get(name, 0.0) + min(sample_us, b - t + sample_us / 2) / 1e3
                t += sample_us
    n = max(len(steps), 1)
    return {"idle_ms_per_step": idle / 1e3 / n,
            "by_frame_ms_per_step": [(k, round(v / n, 2)) for k, v in
                                     sorted(ms.items(), key=lambda kv: -kv[1])[:top]]}


def _tables(prof, cuda: bool) -> str:
    parts = []
    for title, keys in (("GPU time (top 25 kernels and ops)",
                         ("self_device_time_total", "self_cuda_time_total") if cuda else ()),
                        ("host CPU time (top 30 ops, self)", ("self_cpu_time_total",))):
        for key in keys:   # the key's name changed across torch versions
            try:
                parts += [f"## {title}", "", "```",
                          prof.key_averages().table(sort_by=key, row_limit=25 if "GPU" in title else 30,
                                                    max_name_column_width=70), "```", ""]
                break
            except (AttributeError, KeyError, ValueError):
                continue
    return "\n".join(parts)


def write_report(prof, out_dir: Path, label: str, *, cuda: bool) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / "trace.json"
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with open(raw, "rb") as src, gzip.open(out_dir / "trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    rows = trace_summary(trace)
    lines = [f"# {label}: profiled steps", "",
             "| step | wall ms | GPU busy ms | GPU idle | host syncs | sync wait ms | item() |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        busy, idle = "-", "-"   # no GPU (a CPU run): no busy time to speak of
        if cuda and r["wall_ms"]:
            busy, idle = f"{r['gpu_busy_ms']:.1f}", f"{1 - r['gpu_busy_ms'] / r['wall_ms']:.0%}"
        lines.append(f"| {r['step']} | {r['wall_ms']:.1f} | {busy} | {idle} | "
                     f"{r['syncs']} | {r['sync_wait_ms']:.1f} | {r['item_calls']} |")
    sources = sync_sources(trace)
    if sources:
        lines += ["", "Host waits (item() and CUDA syncs) by the Python frame around them, all "
                  "profiled steps:", ""] + [f"- {n} x `{name}`" for name, n in sources]
    idle = idle_by_host_frame(trace) if cuda else None
    if idle and idle["by_frame_ms_per_step"]:
        lines += ["", f"GPU idle {idle['idle_ms_per_step']:.1f} ms a step; what the host ran "
                  "meanwhile (innermost Python frame outside torch, ms a step):", ""]
        lines += [f"- {v} ms `{name}`" for name, v in idle["by_frame_ms_per_step"]]
    (out_dir / "steps.json").write_text(json.dumps(
        {"steps": rows, "sync_sources": sources, "idle": idle}, indent=1))
    (out_dir / "steps.md").write_text("\n".join(lines) + "\n\n" + _tables(prof, cuda))
    return out_dir


def make_callback(spec, out_dir, *, label: str, device, stack=False):
    """A ``TrainerCallback`` that profiles optimizer steps ``START .. START+COUNT-1``."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import TrainerCallback

    start, count = parse_spec(spec)
    stack = str(stack).lower() in ("1", "true", "yes")
    cuda = getattr(device, "type", str(device)) == "cuda"
    rank0 = int(os.environ.get("RANK", "0")) == 0

    class StepProfile(TrainerCallback):
        def __init__(self):
            self.prof, self.span, self.written = None, None, None

        def on_step_begin(self, args, state, control, **kwargs):
            if not rank0 or self.written is not None or not start <= state.global_step < start + count:
                return
            if self.prof is None:
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                self.prof = profile(activities=acts, with_stack=stack)
                self.prof.start()
            # the recipes' probe synchronises before this callback runs and again at the step's
            # end, before on_step_end below: the span holds all of the step's GPU work
            self.span = record_function(f"{STEP_SPAN}{state.global_step}")
            self.span.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self.span is None:
                return
            if cuda:
                torch.cuda.synchronize(device)
            self.span.__exit__(None, None, None)
            self.span = None
            if state.global_step < start + count:    # global_step counts this step already
                return
            self.prof.stop()
            t = time.time()
            self.written = write_report(self.prof, Path(out_dir), label, cuda=cuda)
            print(f"[profile] steps {start}..{start + count - 1} written to {self.written} "
                  f"({time.time() - t:.1f} s)", flush=True)

    return StepProfile()
