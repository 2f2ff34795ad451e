"""Metric curves of a run as one PNG: what the recipes' loss looked like, without a server.

    from gpulaunch.tracking import plot_metrics
    plot_metrics(run_id, "curves.png")              # every non-system metric, one panel each
"""

from __future__ import annotations

import math
from pathlib import Path

from .system import PREFIX


def plot_metrics(run_id: str, path, *, tracking_uri: str | None = None, keys=None,
                 include_system: bool = False, client=None, max_panels: int = 12) -> Path | None:
    """Save the run's metric histories (value against step) to ``path``; None if it has no
    metrics to draw. Needs matplotlib (any backend; Agg is used, no display needed)."""
    if client is None:
        from mlflow.tracking import MlflowClient
        client = MlflowClient(tracking_uri)
    names = sorted(client.get_run(run_id).data.metrics)
    if keys is not None:
        names = [k for k in names if k in set(keys)]
    elif not include_system:
        names = [k for k in names if not k.startswith(PREFIX + "/")]
    names = names[:max_panels]
    if not names:
        return None
    import matplotlib
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # no pyplot: no global state, thread-safe

    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * rows), dpi=100)
    for i, key in enumerate(names):
        hist = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        ax = fig.add_subplot(rows, cols, i + 1)
        ax.plot([m.step for m in hist], [m.value for m in hist],
                marker="." if len(hist) < 50 else None, linewidth=1.2)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"MLflow run {run_id}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
