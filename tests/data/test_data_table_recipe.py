"""The LLM recipes' ``--data`` reads a Delta table (deletion vectors honoured) and an S3 URL
through gpulaunch.data (recipes/llm_common/table_data.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
from data_fixtures import add_deletion_vector

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))

from llm_common import chat_data, table_data  # noqa: E402


def _chat_table(n: int):
    msgs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
            for i in range(n)]
    return pa.table({"id": pa.array(range(n), pa.int64()), "messages": msgs})


def test_delta_table_as_chat_data(tmp_path):
    from deltalake import write_deltalake

    path = str(tmp_path / "chats")
    write_deltalake(path, _chat_table(20), configuration={"delta.enableDeletionVectors": "true"})
    add_deletion_vector(path, {3})
    assert table_data.is_table(path) and not table_data.is_table(str(tmp_path / "x.jsonl"))
    train, evaluation = chat_data.load_chat_datasets(path, seed=0)
    rows = list(train) + list(evaluation)
    assert len(rows) == 19 and {"role": "user", "content": "q3"} not in \
        [r["messages"][0] for r in rows]
    assert rows[0]["messages"][1]["role"] == "assistant"


def test_s3_parquet_as_chat_data(tmp_path, monkeypatch):
    import json

    import pyarrow.parquet as pq
    from s3_server import started

    server = started(monkeypatch)
    try:
        bucket = server.make_bucket("chats")
        (tmp_path / "p").mkdir()
        pq.write_table(_chat_table(10), tmp_path / "p" / "part-0.parquet")
        url = server.upload(str(tmp_path / "p"), bucket + "/train")
        monkeypatch.setenv("GPULAUNCH_DATA_STORAGE_OPTIONS", json.dumps(server.storage_options))
        assert len(table_data.read_rows(url)) == 10
    finally:
        server.stop()
