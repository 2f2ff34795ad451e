"""The live panel in a real Jupyter kernel (nbclient + ipykernel + ipywidgets): its widget
messages for a finished and a failed run, and, on a running 2-rank job, Stacks showing both
ranks and a Stop click sent as a frontend's comm message cancelling the run."""

from __future__ import annotations

import re

import nbformat
import pytest
from conftest import assert_no_survivors
from nbclient import NotebookClient

pytest.importorskip("ipywidgets")

SETUP = ("import os, time\n"
         "from gpulaunch import distributed, runtime as rt\n"
         "def wait_for(path):\n"
         "    while not os.path.exists(path):\n"
         "        time.sleep(0.05)\n")


def _client(nb, tmp_path):
    return NotebookClient(nb, timeout=240, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}})


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            out.append(o["text"])
        elif o.get("output_type") == "error":
            out.append("\n".join(o["traceback"]))
    return "".join(out)


def _html_values(client) -> str:
    """Every HTML widget value the kernel sent (its comm messages, as a frontend sees them)."""
    return "\n".join(str(s.get("value", "")) for s in client.widget_state.values()
                     if s.get("_model_name") == "HTMLModel")


def test_panel_widgets_for_finished_and_failed_runs(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(SETUP),
        nbformat.v4.new_code_cell(
            "@distributed(gpus=2, stream_logs='none')\n"
            "def train(n):\n"
            "    for i in range(n):\n"
            "        rt.report(step=i, loss=1.0 / (i + 1))\n"
            "    return rt.get_global_rank()\n"
            "print('RESULT', train.distributed(4))"),
    ]
    client = _client(nb, tmp_path)
    client.execute()
    assert "RESULT [0, 1]" in _text(nb.cells[1])
    views = [o for o in nb.cells[1].outputs
             if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(views) == 1                       # the panel was displayed in the cell
    html = _html_values(client)
    assert html.count("<b>finished</b>") == 2    # both rows, final
    assert "SUCCEEDED: all 2 ranks returned." in html
    assert "loss=0.25" in html and "<polyline" in html

    nb2 = nbformat.v4.new_notebook()
    nb2.cells = [
        nbformat.v4.new_code_cell(SETUP),
        nbformat.v4.new_code_cell(
            "@distributed(gpus=2, stream_logs='none')\n"
            "def broken():\n"
            "    if rt.get_global_rank() == 1:\n"
            "        raise KeyError('panel failure')\n"
            "    time.sleep(30)\n"
            "try:\n"
            "    broken.distributed()\n"
            "except KeyError as e:\n"
            "    print('CAUGHT', e.rank)"),
    ]
    client2 = _client(nb2, tmp_path)
    client2.execute()
    assert "CAUGHT 1" in _text(nb2.cells[1])
    html = _html_values(client2)
    assert "<b>failed</b>" in html
    assert "FAILED: KeyError" in html and "panel failure" in html   # the outcome replaced it


def test_stacks_and_a_stop_click_on_a_running_job(tmp_path):
    flags = tmp_path / "flags"
    flags.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(SETUP + f"FLAGS = {str(flags)!r}\n"),
        nbformat.v4.new_code_cell(
            "def waiting_in_rank(rank):\n"
            "    open(os.path.join(FLAGS, f'ready{rank}'), 'w').close()\n"
            "    wait_for(os.path.join(FLAGS, 'never'))\n"
            "@distributed(gpus=2, stream_logs='none')\n"
            "def job():\n"
            "    waiting_in_rank(rt.get_global_rank())\n"
            "h = job.submit()\n"
            "for r in (0, 1):\n"
            "    wait_for(os.path.join(FLAGS, f'ready{r}'))\n"
            "p = h.panel\n"
            "print('STATES', p.refresh().states())\n"
            "print('STACKS', p.show_stacks())\n"
            "print('RUNDIR', h.run_dir)\n"
            "print('STOPID', p.stop_button.model_id)"),
        nbformat.v4.new_code_cell(
            "h.wait(60)\n"
            "print('STATUS', h.status.value)\n"
            "print('OUTCOME', p.outcome.value)"),
    ]
    client = _client(nb, tmp_path)
    with client.setup_kernel():
        client.execute_cell(nb.cells[0], 0)
        client.execute_cell(nb.cells[1], 1)
        out = _text(nb.cells[1])
        assert "STATES {0: 'running', 1: 'running'}" in out, out
        stacks = out.split("STACKS", 1)[1]
        assert "--- rank 0 ---" in stacks and "--- rank 1 ---" in stacks
        assert stacks.count("in waiting_in_rank") == 2, stacks
        stop_id = re.search(r"STOPID (\w+)", out).group(1)
        # What JupyterLab sends when the Stop button is clicked.
        msg = client.kc.session.msg("comm_msg", {"comm_id": stop_id, "data": {
            "method": "custom", "content": {"event": "click"}}})
        client.kc.shell_channel.send(msg)
        client.execute_cell(nb.cells[2], 2)
    out = _text(nb.cells[2])
    assert "STATUS CANCELLED" in out, out
    assert "CANCELLED" in out.split("OUTCOME", 1)[1]
    run_dir = re.search(r"RUNDIR (\S+)", _text(nb.cells[1])).group(1)
    assert_no_survivors(run_dir)
