"""``preempt_watch=``: the caller polls a cloud's instance metadata service, and its notice
becomes a checkpoint within the grace period, then the run stops with ``PreemptedError`` naming
the cloud (a preemption: ``max_restarts`` untouched). A real HTTP server on loopback speaks each
cloud's protocol (tests/metadata_server.py); real ranks (gloo), real checkpoints. Also: a
notice file written by another process is kept by the caller (``gpulaunch preempt``), and a
service that cannot be reached costs one warning line, nothing else."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
from conftest import assert_no_survivors, latest_run_dir
from metadata_server import MetadataServer
from test_preemption import _train, _wait_progress

from gpulaunch import distributed
from gpulaunch.caller import cloud_notices
from gpulaunch.common import preemption
from gpulaunch.errors import ConfigurationError, PreemptedError

LONG = 10_000


@pytest.fixture
def server(request, monkeypatch):
    with MetadataServer(request.param) as srv:
        monkeypatch.setenv(cloud_notices.METADATA_URL_ENV, srv.url)
        yield srv


@pytest.mark.unit
@pytest.mark.parametrize("server,source,left", [
    ("aws", "AWS spot instance-action: terminate at ", 60),
    ("gcp", "GCP instance/preempted: TRUE", None),
    ("azure", "Azure scheduled event Preempt not before ", 45),
], indirect=["server"], ids=["aws", "gcp", "azure"])
def test_the_poller_posts_the_clouds_notice_with_its_time_left(tmp_path, server, source, left):
    """A real poller thread against the service: nothing while it says no notice (Azure: an
    eviction of another VM of the scale set is not this one's), then one notice whose grace is
    the cloud's time left less the margin (GCP: its conventional 30 s)."""
    posted = []

    def on_notice(notice):
        posted.append(preemption.post_notice(tmp_path, cloud_notices.grace_for(notice, 99.0),
                                             source=notice.what, restart=False))
    watch = cloud_notices.Watch(server.cloud, on_notice, interval=0.1).start()
    try:
        deadline = time.monotonic() + 10
        while len(server.requests) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert posted == [] and preemption.read_notice(tmp_path) is None
        asked = list(server.requests)       # every request as the protocol wants it
        assert len(asked) >= 6 and all(status in (200, 404) for _, _, status in asked), asked
        server.notice(left_s=left or 60)
        deadline = time.monotonic() + 10
        while not posted and time.monotonic() < deadline:
            time.sleep(0.05)
        watch.thread.join(5)
    finally:
        watch.stop()
    assert not watch.thread.is_alive() and not watch.warned         # one notice, then done
    notice = preemption.read_notice(tmp_path)
    assert notice == posted[0] and notice.source.startswith(source) and not notice.restart
    expected = (left or cloud_notices.CONVENTIONAL_S) - cloud_notices.MARGIN_S
    assert expected - 2.5 <= notice.grace_s <= expected + 0.5, notice


@pytest.mark.parametrize("server", ["aws"], indirect=True)
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_an_aws_spot_notice_checkpoints_and_stops_the_run(tmp_path, server, warm):
    """Cold: ``.submit()``; warm (``keep_alive=``): ``.distributed()`` in this thread while the
    service flips to a notice two minutes ahead; either way a checkpoint within the grace, then
    PreemptedError naming AWS, and no restart spent."""
    ckpt = str(tmp_path / "ck")
    fn = distributed(gpus=2, max_restarts=2, preempt_watch="aws", keep_alive=warm)(_train)

    def flip():
        _wait_progress(ckpt, 0, 4)
        server.notice(left_s=120)
    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    try:
        if warm:
            with pytest.raises(PreemptedError) as e:
                fn.distributed(ckpt, LONG)
            run_dir = e.value.run_dir or latest_run_dir(Path(os.environ["GPULAUNCH_HOME"]))
        else:
            h = fn.submit(ckpt, LONG)
            with pytest.raises(PreemptedError) as e:
                h.result(timeout=120)
            run_dir = h.run_dir
            assert h.attempts == [] and (h.preemptions, h.failures) == (0, 0)
    finally:
        if warm:
            import gpulaunch
            gpulaunch.shutdown()
    flipper.join(5)
    assert "Preempted (AWS spot instance-action: terminate at " in str(e.value)
    saved = preemption.read_saved(run_dir, 0)
    assert saved is not None and e.value.step == saved["step"] >= 4
    notice = preemption.PreemptionNotice(**saved["notice"])
    assert 110 < notice.grace_s <= 115 and not notice.restart
    assert saved["saved_at"] - notice.received_at < notice.grace_s
    assert server.answered(401) == 0                 # every request carried the IMDSv2 token
    assert_no_survivors(run_dir)
    _no_watch_left()


def _no_watch_left(wait: float = 5.0) -> None:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if not [t for t in threading.enumerate() if t.name.startswith("gpulaunch-preempt-watch")]:
            return
        time.sleep(0.1)
    raise AssertionError("a preempt_watch thread outlived its run")


def test_an_unreachable_service_costs_one_warning_line(tmp_path, monkeypatch, capfd):
    with socket.socket() as s:                       # a port nobody listens on: refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(cloud_notices.METADATA_URL_ENV, f"http://127.0.0.1:{port}")
    ckpt = str(tmp_path / "ck")
    began = time.monotonic()
    out = distributed(gpus=2, preempt_watch="gcp")(_train).distributed(ckpt, 30, sleep=0.1)
    took = time.monotonic() - began
    assert [r["step"] for r in out] == [30, 30] and out[0]["attempt"] == 0
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if "cannot reach the GCP metadata service" in ln]
    assert len(lines) == 1, err[-3000:]
    assert f"http://127.0.0.1:{port}" in lines[0] and "the run goes on" in lines[0]
    assert took > 3                         # the watch asked several times, and warned once
    assert_no_survivors(latest_run_dir(Path(os.environ["GPULAUNCH_HOME"])))
    _no_watch_left()


def test_a_notice_file_from_another_process_is_kept_by_the_caller(tmp_path):
    """What ``gpulaunch preempt`` writes: the caller arms the deadline of a notice it did not
    post, and stops a loop that never saves once the grace is over."""
    ckpt = str(tmp_path / "ck")
    h = distributed(gpus=2)(_train).submit(ckpt, LONG, poll=False)
    _wait_progress(ckpt, 0, 3)
    began = time.monotonic()
    preemption.post_notice(h.run_dir, 1, source="a drain script", restart=False)
    with pytest.raises(PreemptedError, match=r"Preempted \(a drain script, grace 1 s\): the "
                                             "grace period ended before every rank had saved"):
        h.result(timeout=60)
    assert time.monotonic() - began < 30
    assert_no_survivors(h.run_dir)


@pytest.mark.unit
def test_refusals_name_the_choices_and_the_reason(monkeypatch, tmp_path):
    with pytest.raises(ConfigurationError, match=r"preempt_watch='gce': not a cloud .* choose "
                                                 r"'aws', 'gcp', 'azure'"):
        distributed(gpus=2, preempt_watch="gce")
    with pytest.raises(ConfigurationError, match="with a Ray run: preemption notices reach the "
                                                 "ranks of runs on this host only"):
        distributed(gpus=2, preempt_watch="aws", cluster="ray://head:10001")
    fn = distributed(gpus=2, preempt_watch="Azure")(_train)
    assert fn.options.preempt_watch == "azure"
    with pytest.raises(ConfigurationError, match="Ray run"):
        fn.with_overrides(remote=True)
    monkeypatch.setenv(cloud_notices.WATCH_ENV, "gce")
    with pytest.raises(ConfigurationError, match=r"\$GPULAUNCH_PREEMPT_WATCH='gce'"):
        distributed(gpus=2)(_train).submit(str(tmp_path / "ck"), 1)
