"""The caller's copy of every node's run directory.

A node agent's ``poll(cursors)`` answers with what changed in its run directory since the
cursors: appended log bytes (``("append", offset, bytes)``) and whole small files that changed
(``("whole", mark, bytes)``: info, result, error, stacks, NCCL traces). ``apply()`` writes them
into the caller's run directory, so that log streaming, ``RunHandle.logs()`` and the outcome
(``caller.collect``) read one directory whatever the backend. Nothing is assumed about shared
storage between nodes.
"""

from __future__ import annotations

import json
import os

from ...common.rundir import RunDir


def apply(run: RunDir, files: dict, cursors: dict, *, node_rank: int, node: dict) -> None:
    """Write one node's file deltas into ``run`` and advance ``cursors`` (in place)."""
    for rel, (kind, mark, data) in files.items():
        path = run.path / rel
        if rel == "hang.json" and path.exists():
            # several nodes' watchdogs may fire; the report names the first one seen
            cursors[rel] = mark
            continue
        path.parent.mkdir(exist_ok=True)
        if kind == "append":
            with open(path, "ab") as f:
                if f.tell() != mark:      # never duplicate or tear a log
                    f.truncate(mark)
                    f.seek(mark)
                f.write(data)
            cursors[rel] = mark + len(data)
        else:
            if rel.endswith(".info.json"):
                data = label_host(data, node_rank, node)
            tmp = path.with_name(f".{path.name}.mirror")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            cursors[rel] = mark


def label_host(data: bytes, node_rank: int, node: dict) -> bytes:
    """A rank's host as the caller reports it: host name, node rank and cluster IP (the host
    name alone is ambiguous on clusters of look-alike machines or pods)."""
    try:
        info = json.loads(data)
    except ValueError:
        return data
    info["node_rank"] = node_rank
    info["host"] = f"{info.get('host', '?')}, node {node_rank} @ {node.get('ip', '?')}"
    return json.dumps(info).encode()
