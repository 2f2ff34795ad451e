"""System metrics of one node, sampled by its node agent while the run is alive.

It runs in the agent (one per node), not in a rank: each node of a multi-node run logs its own
series, keyed ``system/node_<k>/...`` as MLflow's own monitor does with
``MLFLOW_SYSTEM_METRICS_NODE_ID``, so the MLflow UI's "System metrics" tab shows them. The
names match MLflow's (``cpu_utilization_percentage``, ``gpu_0_memory_usage_megabytes``, ...).

Why not MLflow's ``SystemMetricsMonitor`` itself: it reports every GPU NVML sees (not the ones
this run uses, under their CUDA index), its first sample comes only after the 10 s interval, it
blocks ``finish()`` on a thread that may be stuck in a dead store, and it stops as soon as a
rank's library ends the run (HF and Lightning mark it FINISHED before the other ranks are done).
"""

from __future__ import annotations

import os
import threading
import time

import psutil

from ..common import procutil
from ..hardware import nvml

PREFIX = "system"


def visible_gpus(nproc: int | None = None) -> list[str] | None:
    """NVML ids of the GPUs this node's ranks see, by CUDA index (index or UUID strings);
    None means "all"; [] means none (CPU workers)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    ids = [v.strip() for v in raw.split(",") if v.strip()]
    out = []
    for v in ids:
        if v.startswith("-"):        # CUDA stops at the first invalid entry
            break
        out.append(v)
    return out[:nproc] if nproc else out


class NodeSampler:
    """One call of ``sample()`` = one dict of metric name -> value for this node."""

    def __init__(self, node_rank: int, *, nproc: int | None = None, root_pid: int | None = None):
        self.prefix = f"{PREFIX}/node_{node_rank}/"
        self.root = psutil.Process(root_pid or os.getpid())
        self.gpus: list[tuple[int, object]] = []
        self.gpu_error: str | None = None
        self._nvml = None
        psutil.cpu_percent(None)     # prime: the first reading is relative to this call
        ids = visible_gpus(nproc)
        if ids != []:
            self._init_nvml(ids, nproc)

    def _init_nvml(self, ids: list[str] | None, nproc: int | None) -> None:
        # hardware.nvml is the one NVML probe; the session stays open for the sampler's life
        # (NVML counts nested inits; the process ends with it).
        session = nvml.Session()
        nv = session.__enter__()
        if nv is None:
            self.gpu_error = session.error
            return
        self._nvml = nv
        try:
            if ids is None:
                count = nv.nvmlDeviceGetCount()
                ids = [str(i) for i in range(min(count, nproc or count))]
            self.gpus = [(cuda_index, nvml.handle_for(nv, ident))
                         for cuda_index, ident in enumerate(ids)]
        except Exception as e:  # noqa: BLE001 - e.g. MIG ids; CPU/host metrics still work
            self.gpu_error = f"{type(e).__name__}: {e}"

    def sample(self) -> dict[str, float]:
        m: dict[str, float] = {}
        m["cpu_utilization_percentage"] = psutil.cpu_percent(None)
        vm = psutil.virtual_memory()
        m["system_memory_usage_megabytes"] = vm.used / 1e6
        m["system_memory_usage_percentage"] = vm.used / vm.total * 100
        rss = 0
        try:
            for p in self.root.children(recursive=True):
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        m["ranks_memory_rss_megabytes"] = rss / 1e6
        for i, h in self.gpus:
            for name, value in nvml.readings(self._nvml, h).items():
                m[f"gpu_{i}_{name}"] = value
        return {self.prefix + k: round(v, 2) for k, v in m.items()}


class SystemMetricsLogger:
    """A daemon thread that samples every ``interval`` s and logs into the MLflow run.

    The first sample is taken at once and the last one at ``stop()``, so even a short run has
    a point at each end. A failing store is reported once and retried at the next sample;
    ``stop()`` waits a bounded time, so a dead store never holds the agent.

    Importing MLflow takes this process 1-2 s, which would be the whole cost of tracking a
    short launch if the agent had to wait for it before exiting. So samples taken before the
    client exists are kept, and when ``handoff`` (a file in a run directory the caller reads)
    is given and the client is still not ready at ``stop()``, they are written there for the
    caller to log, and the agent goes on at once. With ``handoff`` the client is made only
    after the first interval: a run shorter than that (a warm call) makes no MLflow call while
    it runs."""

    def __init__(self, run_id: str, tracking_uri: str, node_rank: int, interval: float, *,
                 nproc: int | None = None, log=None, handoff=None):
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.node_rank = node_rank
        self.interval = max(0.2, float(interval))
        self.nproc = nproc
        self.log = log or (lambda msg: None)
        self.handoff = handoff
        self.samples = 0
        self.handed_off = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sampler: NodeSampler | None = None
        self._pending: list[tuple[int, int, dict]] = []   # (ms, step, values) not yet logged
        self._client_ready = False
        self._thread = threading.Thread(target=self._loop, name="gpulaunch-system-metrics",
                                        daemon=True)
        self._warned = False

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> "SystemMetricsLogger":
        self._thread.start()
        return self

    def _take(self, step: int) -> tuple[int, int, dict]:
        return int(time.time() * 1000), step, self._sampler.sample()

    def _loop(self) -> None:
        try:
            sampler = NodeSampler(self.node_rank, nproc=self.nproc)
            if sampler.gpu_error and os.path.exists("/dev/nvidiactl"):   # a GPU host: say why
                self.log(f"no GPU system metrics ({sampler.gpu_error})")
            with self._lock:
                self._sampler = sampler
                if self.handed_off:
                    return
                self._pending.append(self._take(0))
            if self.handoff is not None and self._stop.wait(self.interval):
                return      # shorter than an interval: stop() hands both samples to the caller
            with procutil.FORK_QUIET:
                from mlflow.entities import Metric
                from mlflow.tracking import MlflowClient
                client = MlflowClient(self.tracking_uri)
        except Exception as e:  # noqa: BLE001
            self.log(f"system metrics disabled: {type(e).__name__}: {e}")
            return
        with self._lock:
            if self.handed_off:         # stop() gave the samples to the caller meanwhile
                return
            self._client_ready = True
            backlog, self._pending = self._pending, []
        for ms, st, values in backlog:
            self._log_batch(client, Metric, ms, st, values)
        step = len(backlog)
        take_now = not backlog      # a backlog ends with a fresh sample: wait an interval first
        while True:
            stopping = self._stop.is_set()
            if take_now or stopping:
                self._log_batch(client, Metric, *self._take(step))
                step += 1
            take_now = True
            if stopping:
                return
            self._stop.wait(self.interval)   # woken early by stop(): one last sample, then out

    def _log_batch(self, client, Metric, ms: int, step: int, values: dict) -> None:
        try:
            with procutil.FORK_QUIET:   # not while the agent forks ranks (a restart)
                client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step)
                                                       for k, v in values.items()])
            self.samples += 1
        except Exception as e:  # noqa: BLE001
            if not self._warned:
                self._warned = True
                self.log(f"logging system metrics failed (will retry): "
                         f"{type(e).__name__}: {e}")

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self.handoff is not None and self._hand_off():
            return
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _hand_off(self) -> bool:
        """If the client is not ready yet: the samples so far plus a last one go to the caller
        through ``handoff``; the thread drops its own. True if handed off."""
        with self._lock:
            if self._client_ready:
                return False
            self.handed_off = True
            samples = list(self._pending)
            if self._sampler is None:        # the thread has not even sampled yet
                try:
                    self._sampler = NodeSampler(self.node_rank, nproc=self.nproc)
                except Exception:  # noqa: BLE001
                    pass
            if self._sampler is not None:
                try:
                    samples.append(self._take(len(samples)))
                except Exception:  # noqa: BLE001
                    pass
        if not samples:
            return True
        from ..common.rundir import write_json_atomic
        try:
            write_json_atomic(self.handoff, {"run_id": self.run_id, "samples": [
                {"timestamp": ms, "step": st, "values": values} for ms, st, values in samples]})
            self.samples += len(samples)
        except OSError as e:
            self.log(f"could not hand system metrics to the caller: {e}")
        return True
