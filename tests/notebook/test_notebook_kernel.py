"""A function defined in a notebook cell runs through a real Jupyter kernel (nbclient+ipykernel)."""

from __future__ import annotations

import shutil

import nbformat
from conftest import ROOT
from nbclient import NotebookClient


def _outputs(nb) -> str:
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text.append(out["text"])
            elif out.get("output_type") in ("execute_result", "display_data"):
                text.append(out["data"].get("text/plain", ""))
            elif out.get("output_type") == "error":
                text.append("\n".join(out["traceback"]))
    return "".join(text)


def _run(nb, tmp_path):
    client = NotebookClient(nb, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    return _outputs(nb)


def test_quickstart_notebook_executes_in_a_real_kernel(tmp_path):
    path = tmp_path / "quickstart.ipynb"
    shutil.copy(ROOT / "recipes" / "quickstart.ipynb", path)
    out = _run(nbformat.read(path, as_version=4), tmp_path)
    assert "ranks: [0, 1]" in out
    assert "[rank 1] hello gpulaunch from rank 1 of 2" in out  # rank logs reach the cell
    assert "final loss on each rank:" in out


def test_cell_defined_function_error_shows_cell_source(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("from gpulaunch import distributed, runtime as rt\n"
                                  "scale = 7\n"
                                  "class Acc:\n"
                                  "    def __init__(self, v): self.v = v"),
        nbformat.v4.new_code_cell("@distributed(gpus=2)\n"
                                  "def f(k):\n"
                                  "    if rt.get_global_rank() == 1 and k < 0:\n"
                                  "        raise KeyError('cell-defined failure')\n"
                                  "    return Acc(scale * k + rt.get_global_rank())\n"
                                  "print('VALUES', [a.v for a in f.distributed(2)])"),
        nbformat.v4.new_code_cell("try:\n"
                                  "    f.distributed(-1)\n"
                                  "except KeyError as e:\n"
                                  "    print('CAUGHT', type(e).__name__, e.rank)\n"
                                  "    print('CAUSE', e.__cause__)"),
    ]
    out = _run(nb, tmp_path)
    assert "VALUES [14, 15]" in out
    assert "CAUGHT KeyError 1" in out
    assert "raise KeyError('cell-defined failure')" in out  # the cell's source line, from the rank
