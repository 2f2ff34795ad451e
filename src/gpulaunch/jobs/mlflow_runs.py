"""A job in MLflow: one run for the job, and one run per attempt nested under it.

An attempt's run is the one its launch creates (with system metrics, per-rank logs and the
launch parameters): the attempt's process gets ``MLFLOW_RUN_ID`` = the job's run, which the
launch takes as its parent. Once the attempt is over the supervisor tags that run with the
attempt's number, state and root cause. An attempt that never reached its launch (its
environment failed to build, sbatch refused it, its node died) still gets a run here, with
its cause, so a job of N attempts always shows N nested runs.

Every MLflow call is guarded: a store that fails costs a line in supervisor.log, never the job.
"""

from __future__ import annotations

import os

from ..tracking import settings

_STATUS = {"SUCCEEDED": "FINISHED", "CANCELLED": "KILLED"}


class JobRuns:
    def __init__(self, spec, job):
        self.job = job
        self.spec = spec
        self.client = None
        self.run_id = None
        self.uri = None
        self.experiment_id = None
        t = settings.Tracking(**spec.tracking)
        try:
            self.enabled = settings.enabled(t)
        except Exception as e:  # noqa: BLE001 - tracking asked for, mlflow missing
            job.log(f"tracking: {e}")
            self.enabled = False
        if self.enabled:
            self._guard("creating the job's run", lambda: self._create(t))
        if self.run_id is None:
            self.enabled = False

    def _guard(self, what: str, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - see the module docstring
            self.job.log(f"tracking: {what} failed: {type(e).__name__}: {e}")
            return None

    def _create(self, t) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient
        target = settings.target(t)
        client = MlflowClient(target.tracking_uri)
        exp_id = target.experiment_id
        if exp_id is None:
            exp = client.get_experiment_by_name(target.experiment_name)
            if exp is not None and exp.lifecycle_stage != "deleted":
                exp_id = exp.experiment_id
            else:
                root = settings.default_artifact_root() if target.default_store else None
                loc = None if root is None else \
                    f"file://{root}/{target.experiment_name.replace('/', '_')}"
                exp_id = client.create_experiment(target.experiment_name, artifact_location=loc)
        tags = {"gpulaunch.job_id": self.job.job_id, "gpulaunch.job": "job",
                "mlflow.source.name": self.spec.name, "mlflow.source.type": "JOB"}
        tags.update({str(k): str(v) for k, v in (t.tags or {}).items()})
        if target.parent_run_id:
            tags["mlflow.parentRunId"] = target.parent_run_id
        run = client.create_run(exp_id, run_name=t.run_name or self.spec.name, tags=tags)
        self.client, self.uri, self.experiment_id = client, target.tracking_uri, exp_id
        self.run_id = run.info.run_id
        c = self.spec.compute
        for key, value in (("where", c.where), ("gpus_per_node", c.gpus), ("nodes", c.nodes),
                           ("max_retries", self.spec.retry.max_retries),
                           ("command", self.spec.command.kind)):
            client.log_param(self.run_id, f"job.{key}", str(value))
        client.log_artifact(self.run_id, str(self.job.spec_file))
        self.job.log(f"tracking: MLflow run {self.run_id} in {target.tracking_uri}")

    def environ(self) -> dict[str, str]:
        """What an attempt's process needs to nest its launch's run under the job's run."""
        if not self.enabled:
            return {}
        return {"MLFLOW_RUN_ID": self.run_id, "MLFLOW_TRACKING_URI": self.uri,
                "MLFLOW_EXPERIMENT_ID": str(self.experiment_id)}

    def _attempt_run(self, n: int, record: dict) -> str:
        run_id = record.get("mlflow_run_id")
        if run_id:
            return run_id
        found = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`gpulaunch.job_id` = '{self.job.job_id}' "
            f"and tags.`gpulaunch.job_attempt` = '{n}'", max_results=1)
        if found:
            return found[0].info.run_id
        run = self.client.create_run(self.experiment_id, run_name=f"{self.spec.name}-attempt{n}",
                                     tags={"mlflow.parentRunId": self.run_id,
                                           "gpulaunch.job_id": self.job.job_id,
                                           "gpulaunch.job_attempt": str(n)})
        return run.info.run_id

    def attempt_done(self, n: int, record: dict) -> str | None:
        """Tag attempt ``n``'s run with its state and cause; returns its id."""
        if not self.enabled:
            return None

        def tag():
            run_id = self._attempt_run(n, record)
            state = record.get("state", "FAILED")
            self.client.set_tag(run_id, "gpulaunch.attempt_state", state)
            if record.get("cause"):
                self.client.set_tag(run_id, "gpulaunch.root_cause", record["cause"][:5000])
            if self.client.get_run(run_id).info.status == "RUNNING":
                self.client.set_terminated(run_id, _STATUS.get(state, "FAILED"))
            return run_id
        return self._guard(f"recording attempt {n}", tag)

    def end(self, state: str, cause: str | None) -> None:
        if not self.enabled:
            return

        def finish():
            self.client.set_tag(self.run_id, "gpulaunch.state", state)
            if cause:
                self.client.set_tag(self.run_id, "gpulaunch.root_cause", cause[:5000])
            self.client.set_terminated(self.run_id, _STATUS.get(state, "FAILED"))
        self._guard("closing the job's run", finish)
