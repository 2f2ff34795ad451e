"""Jobs: long runs described by a YAML spec, started detached on this host, on Slurm or on a
Ray cluster, retried, watched and managed with ``gpulaunch job ...``.

    spec.py        the spec: one documented dataclass per section, validated with the YAML line
    specfile.py    YAML -> values with their line numbers; overrides (``--override key=value``)
    store.py       a job's private folder under the gpulaunch home: records, attempts, keys
    snapshot.py    the code snapshot (``.gitignore`` honoured, content-hashed, cached by hash)
    environment.py the job's Python: an existing one, or a venv built once per requirements hash
    supervisor.py  the detached process that runs attempts, retries with backoff, records causes
    targets/       where an attempt runs: this host, Slurm (sbatch), Ray (job submission API)
    attempt.py     one attempt's process: the ``gpulaunch run`` pipeline over the spec
    mlflow_runs.py the job's MLflow run and one nested run per attempt
    command.py     ``gpulaunch job run | list | get | logs | cancel``
    reference.py   docs/jobs.md's spec reference, generated from the dataclasses
"""
