"""The live panel as a run callback: shown by ``.distributed()`` / ``.submit()`` inside a
Jupyter kernel; outside one, nothing of it is imported or shown.

``panel=None`` (the default) shows it in a kernel when ipywidgets is installed; ``False`` or
``GPULAUNCH_PANEL=0`` never; ``True`` insists (a clear error without ipywidgets).
"""

from __future__ import annotations

import os
import sys
import time

from ..caller.callbacks import RunCallback
from ..common.records import RunState
from ..errors import ConfigurationError

ENV_SWITCH = "GPULAUNCH_PANEL"
REFRESH_S = 0.5          # the panel redraws at most this often (the caller polls every 0.1 s)


def in_jupyter() -> bool:
    """True inside a Jupyter kernel (not plain IPython, not a script)."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def panel_callback(panel: bool | None):
    """The panel callback for this launch, or None."""
    if panel is False or os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "no"):
        return None
    if not in_jupyter():
        return None
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        if panel:
            raise ConfigurationError("panel=True needs ipywidgets: pip install "
                                     "'gpulaunch[notebook]' (or panel=None to skip it)") from None
        return None
    return PanelCallback()


class PanelCallback(RunCallback):
    name = "panel"

    def __init__(self):
        self.view = None
        self._last = 0.0

    def on_start(self, run) -> None:
        from IPython.display import display

        from .view import PanelView
        self.view = PanelView(run)
        self.view.refresh()
        display(self.view.widget)

    def on_poll(self, run) -> None:
        now = time.monotonic()
        if self.view is not None and now - self._last >= REFRESH_S:
            self._last = now
            self.view.refresh()

    def on_end(self, run, state: RunState) -> None:
        if self.view is not None:
            self.view.finish(state, _outcome_text(run, state))


def _outcome_text(run, state: RunState) -> str:
    """One paragraph for the end: success in words, or the error the caller will raise."""
    if state is RunState.SUCCEEDED:
        return f"{state.value}: all {run.spec.world_size} ranks returned."
    try:
        from ..caller.outcome import settle
        settle(run.outcome())
    except Exception as e:  # noqa: BLE001 - this IS the error the caller gets
        return f"{state.value}: {type(e).__name__}: {e}"
    return str(state.value)
