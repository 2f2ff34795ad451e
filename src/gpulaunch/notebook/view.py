"""The panel's widgets (ipywidgets): a header, one row per rank, rank 0's metric plot, the
buttons, and a detail area; at the end the outcome replaces the live part.

Only HTML and Button widgets, whose values may be set from the thread that follows a
``submit()`` run (an ``Output`` widget captures whatever the kernel prints meanwhile: not
from a thread). Buttons act on the backend's run: Stop = ``run.stop(CANCELLED)`` (what
``cancel()`` does), Stacks = ``caller.stacks``, Logs = the chosen rank's log tail. A button's
click arrives while the kernel is idle: with ``.submit()``, or after a cell ends; a cell
blocked in ``.distributed()`` is stopped with the kernel's own stop button (it cancels too).
"""

from __future__ import annotations

import html
import time

import ipywidgets as w

from ..caller.logstream import tail_text
from ..common.records import RunState, StopReason
from . import gpus, model
from .render import render_header, render_plot, render_rows

LOG_LINES = 200
GPU_REFRESH_S = 2.0      # NVML is read less often than the files


class PanelView:
    def __init__(self, run):
        self.run = run
        self.state: model.PanelState | None = None
        self._gpus: dict = {}
        self._gpu_read = float("-inf")
        self.header = w.HTML()
        self.rows = w.HTML()
        self.plot = w.HTML()
        self.detail = w.HTML()
        self.outcome = w.HTML()
        self.stop_button = w.Button(description="Stop", button_style="danger", icon="stop")
        self.stacks_button = w.Button(description="Stacks", icon="list")
        self.logs_button = w.Button(description="Logs", icon="file-text")
        ranks = list(range(run.spec.world_size))
        self.rank_choice = w.Dropdown(options=ranks, value=0, description="rank",
                                      layout=w.Layout(width="140px"))
        self.stop_button.on_click(lambda _b: self.stop())
        self.stacks_button.on_click(lambda _b: self.show_stacks())
        self.logs_button.on_click(lambda _b: self.show_logs())
        self.buttons = w.HBox([self.stop_button, self.stacks_button, self.logs_button,
                               self.rank_choice])
        self.widget = w.VBox([self.header, self.rows, self.plot, self.buttons, self.detail])
        self.widget.add_class("gpulaunch-panel")

    def refresh(self, outcome: str = "") -> model.PanelState:
        now = time.monotonic()
        if not outcome and now - self._gpu_read >= GPU_REFRESH_S:
            self._gpu_read, self._gpus = now, gpus.read(self.run.spec)
        self.state = model.build(self.run.run, outcome=outcome, gpus=self._gpus)
        self.header.value = render_header(self.state)
        self.rows.value = render_rows(self.state)
        self.plot.value = render_plot(self.state.history)
        return self.state

    def stop(self) -> None:
        self.detail.value = "<i>stopping every rank...</i>"
        self.run.stop(StopReason.CANCELLED)

    def show_stacks(self) -> str:
        from ..caller.stacks import collect_stacks
        text = str(collect_stacks(self.run.run, self.run.spec.world_size))
        self.detail.value = f"<pre>{html.escape(text)}</pre>"
        return text

    def show_logs(self) -> str:
        attempts = self.run.run.attempts()
        r = self.rank_choice.value
        text = tail_text(self.run.run.rank_file(attempts[-1], r, "log"), LOG_LINES) \
            if attempts else ""
        self.detail.value = (f"<b>rank {r}</b> (last {LOG_LINES} lines)<pre style='max-height:"
                             f"24em;overflow:auto'>{html.escape(text)}</pre>")
        return text

    def finish(self, state: RunState, outcome: str) -> None:
        """The run is over: the outcome replaces the live part (rows stay, final)."""
        self.refresh(outcome=outcome)
        ok = state is RunState.SUCCEEDED
        color = "#2ca02c" if ok else "#d62728"
        self.outcome.value = (f"<div style='border-left:4px solid {color};padding-left:8px'>"
                              f"<pre style='white-space:pre-wrap'>{html.escape(outcome)}</pre>"
                              "</div>")
        self.stop_button.disabled = self.stacks_button.disabled = True
        self.buttons.children = (self.logs_button, self.rank_choice)
        self.widget.children = (self.header, self.outcome, self.rows, self.plot, self.buttons,
                                self.detail)
