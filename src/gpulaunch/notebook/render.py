"""The panel's HTML (pure functions of a ``PanelState``: testable without ipywidgets)."""

from __future__ import annotations

import html

from . import model

_COLORS = {"starting": "#888", "running": "#1f77b4", "finished": "#2ca02c", "failed": "#d62728",
           "debugging": "#ff7f0e"}


def render_rows(state: model.PanelState) -> str:
    head = ("<tr><th>rank</th><th>state</th><th>host</th><th>device</th><th>GPU</th><th>progress</th>"
            "<th>metrics</th><th>last line</th></tr>")
    body = []
    for r in state.rows:
        p = r.progress
        prog = "" if p is None else (
            f"<progress value='{p.done}' max='{p.total}'></progress> {p.done}/{p.total}"
            + (f" {p.rate:.3g} {html.escape(p.unit)}" if p.rate else ""))
        g = r.gpu
        gpu = "" if not g else (
            f"{g.get('utilization_percentage', 0):.0f}% "
            f"{g.get('memory_usage_megabytes', 0) / 1024:.1f} GiB")
        metrics = " ".join(f"{html.escape(k)}={_num(v)}" for k, v in sorted(r.metrics.items()))
        body.append(
            f"<tr><td>{r.rank}</td><td style='color:{_COLORS.get(r.state, '#000')}'>"
            f"<b>{r.state}</b></td><td>{html.escape(r.host)}</td><td>{r.device}</td><td>{gpu}</td>"
            f"<td>{prog}</td><td>{metrics}</td>"
            f"<td><code>{html.escape(r.last_line[-120:])}</code></td></tr>")
    return f"<table class='gpulaunch-ranks'>{head}{''.join(body)}</table>"


def render_header(state: model.PanelState) -> str:
    limit = f" / timeout {model.format_elapsed(state.timeout)}" if state.timeout else ""
    again = f", attempt {state.attempt}" if state.attempt else ""
    return (f"<b>{html.escape(state.label)}</b> &middot; {state.world_size} ranks{again} "
            f"&middot; {model.format_elapsed(state.elapsed)}{limit} "
            f"<small style='color:#888'>{html.escape(state.run_id)}</small>")


def render_plot(history: dict, width: int = 320, height: int = 60) -> str:
    """An inline SVG line of rank 0's first metric ('loss' when reported): no plot library."""
    if not history:
        return ""
    name = "loss" if "loss" in history else sorted(history)[0]
    pts = [(s, v) for s, v in history[name] if isinstance(v, (int, float))]
    if len(pts) < 2:
        return ""
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = (width - 4) / ((x1 - x0) or 1)
    sy = (height - 4) / ((y1 - y0) or 1)
    line = " ".join(f"{2 + (x - x0) * sx:.1f},{height - 2 - (y - y0) * sy:.1f}" for x, y in pts)
    return (f"<div>{html.escape(name)} (rank 0): {_num(ys[-1])} "
            f"<small>[{_num(y0)} .. {_num(y1)}]</small><br><svg width='{width}' "
            f"height='{height}'><polyline fill='none' stroke='#1f77b4' stroke-width='1.5' "
            f"points='{line}'/></svg></div>")


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))
