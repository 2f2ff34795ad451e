"""What never goes to disk: the values of ``env=`` and command-line arguments that look like
secrets (``--token X``, ``--api-key=X``, ``HF_TOKEN=X``...).

``launch.json`` is written through ``RunDir.write_launch``, which stores the redacted record
(env= as names only, secret-looking arguments as ``***``); the real values reach the node agent
in memory, in one variable of its environment (``SECRETS_ENV``: a process's environment is
readable by its owner only), and the agent hands them on to the ranks the same way.
"""

from __future__ import annotations

import dataclasses
import json
import re

MASK = "***"
ENV_NOT_STORED = "<value not stored>"
SECRETS_ENV = "GPULAUNCH_LAUNCH_SECRETS"        # caller -> agent: env values, entry argv
ENTRY_ARGV_ENV = "GPULAUNCH_ENTRY_ARGV"          # agent -> ranks: the real entry argv

_SECRET_NAME = re.compile(r"(token|passw(or)?d|secret|api[-_]?key|access[-_]?key|credential|"
                          r"auth)", re.IGNORECASE)


def _is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def mask_argv(argv) -> tuple[str, ...]:
    """``--token abc`` -> ``--token ***``; ``--api-key=abc`` / ``HF_TOKEN=abc`` -> ``...=***``."""
    out, hide_next = [], False
    for arg in argv:
        arg = str(arg)
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        if eq and _is_secret_name(name.lstrip("-")):
            out.append(f"{name}={MASK}")
        elif arg.startswith("-") and not eq and _is_secret_name(arg.lstrip("-")):
            out.append(arg)
            hide_next = True
        else:
            out.append(arg)
    return tuple(out)


def redacted(record):
    """The LaunchRecord as it may be stored: env= names only, secret-looking argv masked."""
    spec = dataclasses.replace(record.spec,
                               env=tuple((k, ENV_NOT_STORED) for k, _ in record.spec.env))
    entry = dataclasses.replace(record.entry, argv=mask_argv(record.entry.argv))
    return dataclasses.replace(record, spec=spec, entry=entry, argv=mask_argv(record.argv))


def secrets_env(record) -> dict[str, str]:
    """The variable that carries what ``redacted`` removed, for the node agent's environment."""
    data = {"env": dict(record.spec.env), "entry_argv": list(record.entry.argv)}
    return {SECRETS_ENV: json.dumps(data)}


def take_secrets(environ) -> dict:
    """The agent's side: read (and remove) the variable; {} when the caller sent none."""
    raw = environ.pop(SECRETS_ENV, None)
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {}
