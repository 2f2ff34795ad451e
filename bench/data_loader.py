"""Loader throughput: gpulaunch.data against mosaicml-streaming and torchdata's StatefulDataLoader.

The same rows (``id`` int64, ``tokens`` int32 x ``--seq``, ``label`` float32) are written once
as Parquet (what gpulaunch.data and the torchdata loader read) and once as MDS shards (the format
mosaicml-streaming reads; it has no Parquet reader), on local disk and on a loopback S3 server
(moto's, started here). Each contender reads one shuffled epoch at batch ``--batch`` with
``--workers`` loader workers, in a process of its own, ``--repeats`` times; the table gives the
median samples/s and bytes/s (bytes of the files read, per second).

* gpulaunch: ``StreamingLoader(StreamingDataset(url, seed=0), batch, num_workers=W)``.
* torchdata: ``StatefulDataLoader`` over an IterableDataset that gives worker w every W-th row
  group (shuffled per epoch) and yields rows, collated by torch's default collate: the loader
  people write by hand for Parquet.
* mosaicml-streaming: ``streaming.StreamingDataset(local=, remote=, shuffle=True)`` in a torch
  ``DataLoader``; on S3 it downloads each shard into its local cache first (cold cache per run).

mosaicml-streaming pins numpy<2.2 and transformers<5, so it lives in a folder of its own:

    pip install --no-deps --target ~/.cache/gpulaunch-bench/streaming mosaicml-streaming==0.13.0 \\
        xxhash zstd python-snappy cramjam brotli catalogue
    PYTHONPATH=src python3 bench/data_loader.py --out /tmp/data-bench          # local + S3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STREAMING = os.path.expanduser("~/.cache/gpulaunch-bench/streaming")
NAMES = ("gpulaunch", "torchdata", "mosaicml-streaming")


def write_data(folder: Path, rows: int, seq: int) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=(rows, seq), dtype=np.int32)
    ids = np.arange(rows, dtype=np.int64)
    labels = rng.random(rows, dtype=np.float32)
    pdir = folder / "parquet"
    pdir.mkdir(parents=True)
    files = 8
    for f in range(files):
        sl = slice(f * rows // files, (f + 1) * rows // files)
        t = pa.table({"id": ids[sl], "label": labels[sl],
                      "tokens": pa.FixedSizeListArray.from_arrays(pa.array(tokens[sl].reshape(-1)), seq)})
        pq.write_table(t, pdir / f"part-{f:03d}.parquet", row_group_size=8192)
    out = {"parquet": str(pdir), "parquet_bytes": sum(p.stat().st_size for p in pdir.iterdir())}
    try:
        sys.path.insert(0, STREAMING)
        from streaming import MDSWriter
    except Exception as e:  # noqa: BLE001
        out["mds_error"] = f"{type(e).__name__}: {e}"
        return out
    mdir = folder / "mds"
    with MDSWriter(out=str(mdir), columns={"id": "int64", "label": "float32", "tokens": "ndarray:int32"},
                   size_limit=1 << 23) as w:
        for i in range(rows):
            w.write({"id": int(ids[i]), "label": float(labels[i]), "tokens": tokens[i]})
    out["mds"] = str(mdir)
    out["mds_bytes"] = sum(p.stat().st_size for p in mdir.iterdir())
    return out


# --------------------------------------------------------------------------- contenders
def run_gpulaunch(url, opts, batch, workers):
    from gpulaunch.data import StreamingDataset, StreamingLoader

    ds = StreamingDataset(url, storage_options=opts, seed=0)
    loader = StreamingLoader(ds, batch, num_workers=workers, rank=0, world_size=1, name=None)
    n = 0
    for b in loader:
        n += len(b["id"])
    return n


def run_torchdata(url, opts, batch, workers):
    import fsspec
    import pyarrow.parquet as pq
    import torch
    from torch.utils.data import IterableDataset, get_worker_info
    from torchdata.stateful_dataloader import StatefulDataLoader

    fs, path = fsspec.core.url_to_fs(url, **(opts or {}))
    files = sorted(p for p in fs.find(path) if p.endswith(".parquet"))
    groups = [(f, g) for f in files for g in range(pq.ParquetFile(fs.open(f)).num_row_groups)]

    class ParquetRows(IterableDataset):
        def __iter__(self):
            fs, _ = fsspec.core.url_to_fs(url, **(opts or {}))   # this worker's (s3fs: not fork-safe)
            info = get_worker_info()
            w, k = (info.id, info.num_workers) if info else (0, 1)
            order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(0)).tolist()
            handles = {}
            for i in order[w::k]:
                f, g = groups[i]
                if f not in handles:
                    handles[f] = pq.ParquetFile(fs.open(f))
                t = handles[f].read_row_group(g)
                ids, labels = t.column("id").to_numpy(), t.column("label").to_numpy()
                toks = t.column("tokens").combine_chunks().flatten().to_numpy().reshape(len(t), -1)
                for j in torch.randperm(len(t)).tolist():
                    yield {"id": ids[j], "label": labels[j], "tokens": toks[j]}

    loader = StatefulDataLoader(ParquetRows(), batch_size=batch, num_workers=workers)
    n = 0
    for b in loader:
        n += len(b["id"])
    return n


def run_mosaic(url, opts, batch, workers):
    sys.path.insert(0, STREAMING)
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    local = tempfile.mkdtemp(prefix="mds-cache-")
    remote = url if "://" in url else None
    ds = StreamingDataset(local=url if remote is None else local, remote=remote, shuffle=True,
                          shuffle_seed=0, batch_size=batch)
    n = 0
    for b in DataLoader(ds, batch_size=batch, num_workers=workers):
        n += len(b["id"])
    return n


RUN = {"gpulaunch": run_gpulaunch, "torchdata": run_torchdata, "mosaicml-streaming": run_mosaic}


def child(args) -> None:
    spec = json.loads(args.one)
    t = time.perf_counter()
    n = RUN[spec["name"]](spec["url"], spec["opts"], args.batch, args.workers)
    print("RESULT " + json.dumps({"rows": n, "seconds": time.perf_counter() - t}), flush=True)


def measure_once(name, url, opts, args, env) -> dict:
    cmd = [sys.executable, __file__, "--one", json.dumps({"name": name, "url": url, "opts": opts}),
           "--batch", str(args.batch), "--workers", str(args.workers), "--out", args.out]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    found = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not found:
        return {"error": (p.stderr or p.stdout)[-800:]}
    return json.loads(found[-1][7:])


def summarize(runs: list[dict], nbytes) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"]}
    s = statistics.median(r["seconds"] for r in ok)
    return {"rows": ok[0]["rows"], "seconds": s, "samples_per_s": ok[0]["rows"] / s,
            "bytes_per_s": nbytes / s, "runs": [r["seconds"] for r in ok]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--where", default="local,s3")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        child(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    work = Path(tempfile.mkdtemp(prefix="gpulaunch-data-bench-"))
    data = write_data(work, args.rows, args.seq)
    results = []
    for where in args.where.split(","):
        server = None
        urls = {"parquet": data["parquet"], "mds": data.get("mds")}
        opts = None
        if where == "s3":
            sys.path.insert(0, str(ROOT / "tests" / "data"))
            from s3_server import S3Server  # the tests' loopback moto server
            server = S3Server(auth=False)
            env.update(server.env(), S3_ENDPOINT_URL=server.endpoint)
            bucket = server.make_bucket("bench")
            opts = server.storage_options
            urls = {"parquet": server.upload(data["parquet"], bucket + "/parquet"),
                    "mds": server.upload(data["mds"], bucket + "/mds") if data.get("mds") else None}
        try:
            runs = {name: [] for name in NAMES}
            for _ in range(args.repeats):          # A B C A B C ...: drift hits all alike
                for name in NAMES:
                    url = urls["mds"] if name == "mosaicml-streaming" else urls["parquet"]
                    runs[name].append({"error": data.get("mds_error", "no MDS data")} if url is None
                                      else measure_once(name, url, opts, args, env))
            for name in NAMES:
                nbytes = data.get("mds_bytes") if name == "mosaicml-streaming" else data["parquet_bytes"]
                r = summarize(runs[name], nbytes or 0)
                r.update(name=name, where=where)
                results.append(r)
                print(json.dumps(r), flush=True)
        finally:
            if server is not None:
                server.stop()
    lines = [f"rows {args.rows}, tokens {args.seq} int32 per row, batch {args.batch}, {args.workers} "
             f"workers, median of {args.repeats} (interleaved); {os.cpu_count()} CPUs, load average "
             f"{os.getloadavg()[0]:.1f} at the end; `python3 bench/data_loader.py "
             f"--rows {args.rows} --seq {args.seq} --batch {args.batch} --workers {args.workers}`", "",
             "| where | loader | samples/s | MB/s | gpulaunch x |", "|---|---|---|---|---|"]
    for r in results:
        ours = next((x for x in results if x["where"] == r["where"] and x["name"] == "gpulaunch"), {})
        if "error" in r:
            lines.append(f"| {r['where']} | {r['name']} | error: {r['error'][-120:]!r} | | |")
            continue
        ratio = ours.get("samples_per_s", 0) / r["samples_per_s"] if r["samples_per_s"] else 0
        lines.append(f"| {r['where']} | {r['name']} | {r['samples_per_s']:,.0f} | "
                     f"{r['bytes_per_s'] / 1e6:,.1f} | {ratio:.2f} |")
    (out / "data_loader.json").write_text(json.dumps(results, indent=2))
    (out / "data_loader.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
