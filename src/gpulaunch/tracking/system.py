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


# MLflow takes at most 1000 metrics in one log_batch (a sample is 4 + 5 per GPU of them).
BATCH_METRICS = 900
# Samples a failing store left unlogged are kept for the next try (or the caller) up to this
# many (an hour at the default 5 s); older ones are dropped, saying so.
MAX_KEPT = 720


def log_samples(client, run_id: str, samples) -> None:
    """Log ``(timestamp_ms, step, values)`` samples into the run, in batches MLflow takes."""
    from mlflow.entities import Metric
    metrics = [Metric(k, v, ms, step) for ms, step, values in samples for k, v in values.items()]
    for i in range(0, len(metrics), BATCH_METRICS):
        client.log_batch(run_id, metrics=metrics[i:i + BATCH_METRICS])


class SystemMetricsLogger:
    """A daemon thread that samples every ``interval`` s and logs into the MLflow run.

    The first sample is taken at once and the last one at ``stop()``, so even a short run has
    a point at each end. A failing store is reported once; what it did not take is kept and
    retried with the next sample; ``stop()`` waits a bounded time, so a dead store never holds
    the agent.

    Importing MLflow takes this process 1-2 s, which would be the whole cost of tracking a
    short launch if the agent had to wait for it before exiting. So samples taken before the
    client exists are kept, and when ``handoff`` (a file in a run directory the caller reads)
    is given, whatever is not logged at ``stop()`` is written there for the caller to log at
    the run's end, and the thread logs nothing more: the samples of a client not ready yet
    (the agent goes on at once), and those of a store that failed or outlasted ``stop()``'s
    wait (a warm pool's sqlite store written by the previous call's end in this process).
    With ``handoff`` the client is made only after the first interval: a run shorter than
    that (a warm call) makes no MLflow call while it runs."""

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
        self._lock = threading.Lock()       # guards the fields below and the step numbers
        self._sampler: NodeSampler | None = None
        self._step = 0                      # the next sample's
        self._pending: list[tuple[int, int, dict]] = []   # (ms, step, values) not yet logged
        self._inflight: list[tuple[int, int, dict]] = []  # being logged by the thread now
        self._end_taken = False             # the thread took its sample at stop()
        self._client_ready = False
        self._thread = threading.Thread(target=self._loop, name="gpulaunch-system-metrics",
                                        daemon=True)
        self._warned = False
        self._dropping = False

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> "SystemMetricsLogger":
        self._thread.start()
        return self

    def _take(self) -> tuple[int, int, dict]:
        """The next sample (the caller holds ``_lock``: steps stay 0, 1, ... without a gap
        whichever thread takes it)."""
        sample = int(time.time() * 1000), self._step, self._sampler.sample()
        self._step += 1
        return sample

    def _loop(self) -> None:
        try:
            sampler = NodeSampler(self.node_rank, nproc=self.nproc)
            if sampler.gpu_error and os.path.exists("/dev/nvidiactl"):   # a GPU host: say why
                self.log(f"no GPU system metrics ({sampler.gpu_error})")
            with self._lock:
                if self.handed_off:
                    return
                self._sampler = sampler
                self._pending.append(self._take())
            if self.handoff is not None and self._stop.wait(self.interval):
                return      # shorter than an interval: stop() hands the samples to the caller
            with procutil.FORK_QUIET:
                import mlflow.entities  # noqa: F401 - here, not while the agent forks ranks
                from mlflow.tracking import MlflowClient
                client = MlflowClient(self.tracking_uri)
        except Exception as e:  # noqa: BLE001
            self.log(f"system metrics disabled: {type(e).__name__}: {e}")
            return
        with self._lock:
            if self.handed_off:         # stop() gave the samples to the caller meanwhile
                return
            self._client_ready = True
        take_now = False            # the backlog ends with a fresh sample: wait an interval first
        while True:
            stopping = self._stop.is_set()
            with self._lock:
                if self.handed_off:     # stop() stopped waiting: the rest went to the caller
                    return
                if take_now or stopping:
                    self._pending.append(self._take())
                    self._end_taken = stopping
                self._inflight, self._pending = self._pending, []
            self._log_inflight(client)
            if stopping:
                return
            take_now = True
            self._stop.wait(self.interval)   # woken early by stop(): one last sample, then out

    def _log_inflight(self, client) -> None:
        ok = self._log_batch(client, self._inflight)
        with self._lock:
            batch, self._inflight = self._inflight, []
            if ok or self.handed_off:   # handed off: the caller has them too
                return
            self._pending[:0] = batch   # the next try, or the caller's at stop()
            if len(self._pending) > MAX_KEPT:
                del self._pending[:-MAX_KEPT]
                if not self._dropping:
                    self._dropping = True
                    self.log(f"the store still fails; only the last {MAX_KEPT} system samples "
                             f"are kept")

    def _log_batch(self, client, samples) -> bool:
        if not samples:
            return True
        try:
            with procutil.FORK_QUIET:   # not while the agent forks ranks (a restart)
                log_samples(client, self.run_id, samples)
            self.samples += len(samples)
            return True
        except Exception as e:  # noqa: BLE001
            if not self._warned:
                self._warned = True
                self.log(f"logging system metrics failed (kept for the next try"
                         f"{', then the caller' if self.handoff is not None else ''}): "
                         f"{type(e).__name__}: {e}")
            return False

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._lock:
            # Without a client yet the samples go to the caller at once (the agent never
            # waits for an MLflow import); with one, the thread logs its last sample.
            wait = self._client_ready or self.handoff is None
        if wait and self._thread.is_alive():
            self._thread.join(timeout)
        if self.handoff is not None:
            self._hand_off()
        elif self._pending or self._thread.is_alive():
            self.log("system metrics: the last samples may be missing (the store failed or "
                     "did not answer in time)")

    def _hand_off(self) -> None:
        """Whatever the thread has not logged, and the end sample if it did not take it, goes
        to the caller through ``handoff``; the thread logs nothing more. A batch still in
        flight (the wait ran out) is handed off too: if it lands after all, the caller's copy
        is the same metrics, which an SQL store keeps once."""
        with self._lock:
            self.handed_off = True
            samples = self._inflight + self._pending
            self._pending = []
            if self._sampler is None:        # the thread has not even sampled yet
                try:
                    self._sampler = NodeSampler(self.node_rank, nproc=self.nproc)
                except Exception:  # noqa: BLE001
                    pass
            if self._sampler is not None and not self._end_taken:
                try:
                    if self._step == 0:
                        # The call ended before the thread took its start sample (a warm call
                        # is milliseconds; a loaded host may not run the thread that soon):
                        # both ends are taken now, so the run still has a point at each.
                        samples.append(self._take())
                    samples.append(self._take())
                except Exception:  # noqa: BLE001
                    pass
            self._end_taken = True          # a second stop() adds nothing, overwrites nothing
        if samples:
            self._write_handoff(samples)

    def _write_handoff(self, samples) -> None:
        from ..common.rundir import write_json_atomic
        try:
            write_json_atomic(self.handoff, {"run_id": self.run_id, "samples": [
                {"timestamp": ms, "step": st, "values": values} for ms, st, values in samples]})
            self.samples += len(samples)
        except OSError as e:
            self.log(f"could not hand system metrics to the caller: {e}")
