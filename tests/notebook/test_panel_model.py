"""The panel's pure state (notebook/model.py) from real run directories: a real 2-rank run that
prints a tqdm bar and calls rt.report, a failing run; no Jupyter needed (seconds)."""

from __future__ import annotations

import io

import pytest

from gpulaunch import distributed, runtime
from gpulaunch.common.rundir import RunDir
from gpulaunch.errors import ConfigurationError
from gpulaunch.notebook import callback, model, render


def test_parse_progress_reads_a_real_tqdm_bar():
    from tqdm import tqdm
    buf = io.StringIO()
    bar = tqdm(total=50, file=buf, mininterval=0, ascii=False)
    bar.update(20)
    bar.refresh()
    line = buf.getvalue().split("\r")[-1]
    p = model.parse_progress(line)
    assert (p.done, p.total) == (20, 50) and p.fraction == pytest.approx(0.4)
    assert model.parse_progress("epoch 3 loss 0.5") is None
    slow = model.parse_progress(" 10%|█         | 1/10 [00:04<00:36,  4.00s/it]")
    assert slow.rate == pytest.approx(0.25) and slow.unit == "it/s"   # s/it turned into a rate


def _train(steps):
    import sys

    from tqdm import tqdm

    from gpulaunch import runtime as rt
    for i in tqdm(range(steps), file=sys.stderr, mininterval=0):
        rt.report(step=i, loss=1.0 / (i + 1), lr=0.1)
    print("training done on rank", rt.get_global_rank())
    return rt.get_global_rank()


def test_state_of_a_finished_run_has_rows_progress_metrics_history():
    h = distributed(gpus=2, stream_logs="none", panel=False)(_train).submit(6)
    assert h.result(timeout=60) == [0, 1]
    st = model.build(RunDir(h.run_dir), outcome="SUCCEEDED")
    assert st.states() == {0: "finished", 1: "finished"}
    assert st.world_size == 2 and st.elapsed > 0
    for row in st.rows:
        assert row.device == "cpu" and row.host
        assert row.metrics == {"loss": pytest.approx(1 / 6), "lr": 0.1}
        assert row.last_line == f"training done on rank {row.rank}"
    assert [s for s, _ in st.history["loss"]] == list(range(6))
    html = render.render_rows(st) + render.render_plot(st.history)
    assert "<b>finished</b>" in html and "loss=0.1667" in html and "<polyline" in html
    # NVML readings (gpus.read on a GPU host) land on the row of the rank with that local rank
    with_gpu = model.build(RunDir(h.run_dir), gpus={1: {"utilization_percentage": 37.0,
                                                        "memory_usage_megabytes": 1536.0}})
    assert with_gpu.rows[0].gpu == {} and with_gpu.rows[1].gpu["utilization_percentage"] == 37
    assert "<td>37% 1.5 GiB</td>" in render.render_rows(with_gpu)


def test_gpu_ids_follow_cuda_visible_devices(monkeypatch):
    from gpulaunch.common.records import LaunchSpec
    from gpulaunch.notebook import gpus
    spec = LaunchSpec(nproc_per_node=2, device="cuda")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpus.visible_ids(spec) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert gpus.visible_ids(spec) == ["3", "5"]
    pinned = LaunchSpec(nproc_per_node=2, device="cuda", env=(("CUDA_VISIBLE_DEVICES", "GPU-ab,7"),))
    assert gpus.visible_ids(pinned) == ["GPU-ab", "7"]
    assert gpus.read(LaunchSpec(nproc_per_node=2, device="cpu")) == {}


def _fail():
    import time

    from gpulaunch import runtime as rt
    if rt.get_global_rank() == 1:
        raise ValueError("rank one breaks")
    time.sleep(30)


def test_state_of_a_failed_run_marks_the_failing_rank():
    h = distributed(gpus=2, stream_logs="none", panel=False)(_fail).submit()
    with pytest.raises(ValueError):
        h.result(timeout=60)
    st = model.build(RunDir(h.run_dir))
    assert st.states()[1] == "failed"
    assert st.states()[0] != "finished"      # stopped, never returned
    assert "ValueError: rank one breaks" in st.rows[1].last_line


def test_report_refuses_non_numbers_and_is_a_no_op_outside_a_run(monkeypatch, tmp_path):
    runtime.report(loss=1.0)                  # no run dir: nothing written, no error
    monkeypatch.setenv("GPULAUNCH_RUN_DIR", str(tmp_path))
    (tmp_path / "attempt0").mkdir()
    with pytest.raises(ConfigurationError, match="report numbers"):
        runtime.report(loss="low")
    runtime.report(step=3, loss=0.5)
    assert model.read_metrics(tmp_path / "attempt0" / "rank0.metrics.jsonl")[0]["step"] == 3


def test_panel_is_off_outside_jupyter_and_by_switch(monkeypatch):
    assert not callback.in_jupyter()
    assert callback.panel_callback(None) is None and callback.panel_callback(True) is None
    with pytest.raises(ConfigurationError, match="panel="):
        distributed(gpus=2, panel="yes")
