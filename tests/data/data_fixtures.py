"""Small datasets in every format the data layer reads, each row carrying a unique ``id``."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import time
from pathlib import Path


def write_parquet(folder, n: int, files: int = 3, row_group: int = 7, start: int = 0) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-n // files)
    for f in range(files):
        ids = list(range(start + f * per, start + min(n, (f + 1) * per)))
        if not ids:
            continue
        t = pa.table({"id": pa.array(ids, pa.int64()),
                      "x": pa.array([float(i) / 10 for i in ids], pa.float32()),
                      "tokens": pa.array([[i, i + 1, i + 2] for i in ids], pa.list_(pa.int32())),
                      "name": pa.array([f"row-{i}" for i in ids])})
        pq.write_table(t, folder / f"part-{f:03d}.parquet", row_group_size=row_group)
    return str(folder)


def write_delta(folder, n: int, *, delete=(), commits: int = 2) -> str:
    """A Delta table of ``n`` rows in ``commits`` appends; rows whose id is in ``delete`` are
    removed by an inline deletion vector (what Spark and Databricks write; deltalake's own
    DELETE rewrites files instead)."""
    import pyarrow as pa
    from deltalake import write_deltalake

    folder = str(folder)
    per = -(-n // commits)
    for c in range(commits):
        ids = list(range(c * per, min(n, (c + 1) * per)))
        t = pa.table({"id": pa.array(ids, pa.int64()),
                      "x": pa.array([float(i) / 10 for i in ids], pa.float32())})
        write_deltalake(folder, t, mode="append",
                        configuration={"delta.enableDeletionVectors": "true"} if c == 0 else None)
    if delete:
        add_deletion_vector(folder, set(delete))
    return folder


def add_deletion_vector(folder: str, ids: set) -> None:
    import pyarrow.parquet as pq
    from pyroaring import BitMap
    from zmq.utils import z85

    log = Path(folder) / "_delta_log"
    version = max(int(p.stem) for p in log.glob("*.json"))
    live = {}
    for v in range(version + 1):
        for line in (log / f"{v:020d}.json").read_text().splitlines():
            a = json.loads(line)
            if "add" in a:
                live[a["add"]["path"]] = a["add"]
            if "remove" in a:
                live.pop(a["remove"]["path"], None)
    now = int(time.time() * 1000)
    actions = [{"commitInfo": {"timestamp": now, "operation": "DELETE"}}]
    for path, add in live.items():
        col = pq.read_table(Path(folder) / path, columns=["id"]).column("id").to_pylist()
        rows = [i for i, v in enumerate(col) if v in ids]
        if not rows:
            continue
        bitmap = struct.pack("<i", 1681511377) + struct.pack("<q", 1) + struct.pack("<i", 0) \
            + BitMap(rows).serialize()
        encoded = z85.encode(bitmap + b"\0" * (-len(bitmap) % 4)).decode()
        new = dict(add, dataChange=True, modificationTime=now,
                   deletionVector={"storageType": "i", "pathOrInlineDv": encoded,
                                   "sizeInBytes": len(bitmap), "cardinality": len(rows)})
        actions.append({"remove": {"path": path, "deletionTimestamp": now, "dataChange": True,
                                   "extendedFileMetadata": True, "size": add["size"],
                                   "partitionValues": add.get("partitionValues", {})}})
        actions.append({"add": new})
    (log / f"{version + 1:020d}.json").write_text("\n".join(json.dumps(a) for a in actions) + "\n")


def write_jsonl(folder, n: int, files: int = 3) -> str:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-n // files)
    for f in range(files):
        lines = [json.dumps({"id": i, "text": f"sample {i}"})
                 for i in range(f * per, min(n, (f + 1) * per))]
        (folder / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n\n")
    return str(folder)


def write_text(folder, n: int, files: int = 2) -> str:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-n // files)
    for f in range(files):
        (folder / f"part-{f}.txt").write_text(
            "".join(f"{i}\n" for i in range(f * per, min(n, (f + 1) * per))))
    return str(folder)


def write_webdataset(folder, n: int, shards: int = 2) -> str:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-n // shards)
    for s in range(shards):
        with tarfile.open(folder / f"shard-{s:05d}.tar", "w") as tar:
            for i in range(s * per, min(n, (s + 1) * per)):
                for ext, data in (("cls", str(i).encode()), ("txt", f"caption {i}".encode())):
                    info = tarfile.TarInfo(f"sample{i:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(folder)


def write_hf_arrow(folder, n: int) -> str:
    import datasets

    ds = datasets.Dataset.from_dict({"id": list(range(n)), "text": [f"t{i}" for i in range(n)]})
    ds.save_to_disk(str(folder), num_shards=2)
    return str(folder)
