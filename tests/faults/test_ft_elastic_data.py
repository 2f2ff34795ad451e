"""The elastic run's data (``r.loader``, gpulaunch/ft/elastic_data.py): one stream position for
the run, re-cut over the live replica groups at every step.

Pure arithmetic (``unit``): the step's rows tile the global batch once for any number of live
groups; runs of stream positions split at epoch ends. A simulated torchft manager (quorums,
dropped steps, healing with the state sent at the quorum and loaded at the commit, as torchft
0.2.0 does) drives the real loader over a real Parquet dataset: sizes 3 -> 2 -> 1 -> 3, a
dropped step, a replacement; the committed rows are the stream's prefix, each once.

Real processes (``slow``): two groups, one SIGKILLed and not replaced (no capacity), one group
alone, capacity back, two groups; every sample id each group trained in a committed step is
logged, and the committed ids are the stream's prefix, each exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections import Counter
from pathlib import Path

import pytest
from conftest import alive

from gpulaunch.data.stream import StreamReader, epoch_spans
from gpulaunch.errors import ConfigurationError
from gpulaunch.ft.elastic_data import position, rank_part, shard_rows, step_rows


def _table(folder: Path, n: int, row_group: int = 5) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    folder.mkdir(parents=True, exist_ok=True)
    half = n // 2
    for f, ids in enumerate((range(half), range(half, n))):
        pq.write_table(pa.table({"id": pa.array(list(ids), pa.int64()),
                                 "x": pa.array([i / n for i in ids], pa.float32())}),
                       folder / f"part-{f}.parquet", row_group_size=row_group)
    return str(folder)


def _dataset(path):
    from gpulaunch.data import StreamingDataset
    return StreamingDataset(path, seed=3, shuffle_rows=12)


def _stream_ids(path, a: int, b: int) -> list[int]:
    """The ids at stream positions [a, b), from each epoch's order (block + row in block)."""
    ds = _dataset(path)
    starts = [0]
    for n in ds.source.block_rows:
        starts.append(starts[-1] + int(n))
    out = []
    for e, lo, hi in epoch_spans(a, b, ds.num_rows):
        blocks, rows = ds.order(e).rows(lo, hi)
        out += [starts[int(k)] + int(r) for k, r in zip(blocks, rows)]
    return out


# ------------------------------------------------------------------------------- pure logic

@pytest.mark.unit
def test_a_steps_rows_are_the_global_batch_once_for_any_live_groups():
    for shards in (1, 2, 3, 5):
        for live in range(1, shards + 1):
            for pos in (0, 7, 1000):
                runs = sorted(r for rank in range(live)
                              for r in step_rows(pos, rank, live, shards, 4))
                assert runs == [shard_rows(pos, k, 4) for k in range(shards)]
                assert runs[0][0] == pos and runs[-1][1] == pos + shards * 4
    # healing (rank None): rank 0's rows, which torchft zeroes the gradient of
    assert step_rows(8, None, 1, 2, 4) == [(8, 12), (12, 16)]
    assert step_rows(8, 1, 2, 2, 4) == [(12, 16)]
    # the run's first step: one group's gradient counts (torchft's init_sync), so all train all
    assert step_rows(0, 1, 2, 2, 4, first=True) == [(0, 4), (4, 8)]


@pytest.mark.unit
def test_the_ranks_of_a_sharded_group_split_each_shard_between_them():
    """HSDP: the K ranks of a group read disjoint parts that tile the shard's run."""
    run = shard_rows(100, 2, 12)                     # rows [124, 136)
    parts = [rank_part(run, k, 3) for k in range(3)]
    assert parts == [(124, 128), (128, 132), (132, 136)]
    assert rank_part(run, 0, 1) == run


def test_position_follows_the_committed_step_from_its_anchor():
    assert position((0, 0), 0, 6) == 0 and position((0, 0), 5, 6) == 30
    assert position((30, 5), 7, 6) == 42          # a healed group: the peer's anchor
    with pytest.raises(ConfigurationError, match="the step went back"):
        position((30, 5), 4, 6)


@pytest.mark.unit
def test_stream_runs_split_at_epoch_ends():
    assert epoch_spans(0, 10, 10) == [(0, 0, 10)]
    assert epoch_spans(8, 23, 10) == [(0, 8, 10), (1, 0, 10), (2, 0, 3)]
    assert epoch_spans(20, 20, 10) == []
    with pytest.raises(ValueError):
        epoch_spans(5, 4, 10)


@pytest.mark.unit
def test_the_stream_reader_reads_each_epochs_order_across_its_end(tmp_path):
    path = _table(tmp_path / "t", 23)
    reader = StreamReader(_dataset(path))
    try:
        first = reader.read(0, 23)["id"].tolist()
        assert sorted(first) == list(range(23)) and first != list(range(23))    # shuffled
        across = reader.read(20, 30)["id"].tolist()
        assert across == _stream_ids(path, 20, 30) and across[:3] == first[20:]
        assert sorted(reader.read(23, 46)["id"].tolist()) == list(range(23))
    finally:
        reader.close()


# ------------------------------------------------ the real loader under a simulated manager

class _Manager:
    """What ElasticLoader asks of torchft's Manager, with torchft 0.2.0's order of events."""

    def __init__(self):
        self.step, self.rank, self.world, self.healing = 0, None, 0, False
        self.fns, self.pending = {}, None

    def register_state_dict_fn(self, key, load, save):
        assert key not in self.fns
        self.fns[key] = (load, save)

    def participating_rank(self):
        return self.rank

    def num_participants(self):
        return self.world

    def is_participating(self):
        return self.rank is not None and not self.healing

    def current_step(self):
        return self.step


class _Model:
    def no_sync(self):
        return contextlib.nullcontext()


def _group(path):
    from gpulaunch.ft.replicated import Replicated
    r = Replicated(model=_Model(), optimizer=None, manager=_Manager(), progress=None)
    return r, r.loader(_dataset(path), batch_size=3, shards=3)


def _quorum(groups: dict, live: list):
    """Like torchft's: the groups at the highest step take part (ranked by id); the others
    heal: a participant's state (taken now) is loaded at their commit, their step set now. At
    step 0 (init_sync) every group but the first heals from it, yet keeps its rank and counts
    as a participant (its gradient zeroed)."""
    top = max(groups[g][0].manager.step for g in live)
    part = sorted(g for g in live if groups[g][0].manager.step == top)
    src = groups[part[0]][0].manager
    for g in live:
        m = groups[g][0].manager
        m.world = len(part)
        m.rank = part.index(g) if g in part else None
        m.healing = g != part[0] if top == 0 else g not in part
        if m.healing:
            m.step = top
            m.pending = {k: save() for k, (_, save) in src.fns.items()}


def _commit(groups: dict, live: list, ok: bool, log: list):
    for g in live:
        r, loader = groups[g]
        m = r.manager
        if m.healing:                                   # applied at should_commit
            for k, (load, _) in m.fns.items():
                load(m.pending[k])
        if ok:
            if loader.participating:
                log.append((m.step + 1, loader.rows))
            m.step += 1


@pytest.mark.unit
def test_sizes_3_2_1_3_a_dropped_step_and_a_replacement_commit_each_row_once(tmp_path):
    path = _table(tmp_path / "t", 40)
    groups = {g: _group(path) for g in (0, 1, 2)}
    log, ids = [], []
    # (live groups, committed?) per step; groups 1 and 2 are lost, later replaced by new ones
    plan = [([0, 1, 2], True)] * 4 + [([0, 1, 2], False)] + [([0, 1], True)] * 3 + \
        [([0], True)] * 5 + ["new 1", "new 2"] + [([0, 1, 2], True)] * 2 + \
        [([0, 1, 2], False), ([0, 2], True), ([0, 2], True)]
    for item in plan:
        if isinstance(item, str):
            g = int(item.split()[1])
            groups[g][1].close()
            groups[g] = _group(path)                   # a fresh process: position 0, step 0
            continue
        live, ok = item
        _quorum(groups, live)
        for g in live:
            loader = groups[g][1]
            got = [b["id"].tolist() for b in loader]
            if loader.participating and ok:
                ids += sum(got, [])
        _commit(groups, live, ok, log)
    steps = [s for s, _ in log]
    final = groups[0][0].manager.step
    assert sorted(set(steps)) == list(range(1, final + 1)) and final == 16
    # the committed runs of positions tile 0 .. 16 steps x 9 rows, each once
    runs = sorted(r for _, rows in log for r in rows)
    assert [a for a, _ in runs] == list(range(0, final * 9, 3))
    assert all(b - a == 3 for a, b in runs)
    assert Counter(ids) == Counter(_stream_ids(path, 0, final * 9))     # 144 rows: 3.6 epochs
    assert all(groups[g][1].position == final * 9 for g in (0, 2))
    for _, loader in groups.values():
        loader.close()


@pytest.mark.unit
def test_a_healing_group_takes_the_peers_position_and_refuses_other_data(tmp_path):
    path = _table(tmp_path / "t", 40)
    (r0, a), (r1, b) = _group(path), _group(path)
    r0.manager.step = 7
    b.load_state_dict(a.state_dict())
    r1.manager.step = 7
    assert b.position == a.position == 63 and b.epoch == 1
    other = _group(_table(tmp_path / "u", 41))[1]
    with pytest.raises(ConfigurationError, match="would read different streams"):
        other.load_state_dict(a.state_dict())
    for loader in (a, b, other):
        loader.close()


# ---------------------------------------------------------------------------- real processes

def _train_on_data(steps: int, path: str, log_dir: str, pause: float):
    """Trains on ``r.loader``'s batches (2 shards of 3 rows a step) and logs, per step, the
    step, the live groups and (if its gradient counted) every sample id it trained, then
    whether the step was dropped."""
    import time

    import torch

    from gpulaunch import ft
    from gpulaunch.data import StreamingDataset
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    r = ft.replicated(model, torch.optim.SGD(model.parameters(), lr=0.05))
    data = r.loader(StreamingDataset(path, seed=3, shuffle_rows=12), batch_size=3)
    log = Path(log_dir, f"ids.replica{ft.replica_id()}.attempt{ft.attempt()}.jsonl")
    with open(log, "a") as f:
        while r.step < steps:
            r.optimizer.zero_grad()
            ids = []
            for i, batch in enumerate(data):
                ids += batch["id"].tolist()
                if i == len(data.rows) - 1:
                    # written before the last backward, whose gradient all-reduce may put this
                    # group's rows into the survivor's update even if it is killed right after
                    counted = data.participating    # a healing group's rows do not count
                    f.write(json.dumps({"step": r.step + 1, "n": r.participants,
                                        "rows": data.rows if counted else [],
                                        "ids": ids if counted else []}) + "\n")
                    f.flush()
                x = batch["x"].unsqueeze(1)
                ((r.model(x) - 3 * x).pow(2).mean() * data.weight).backward()
            if not r.optimizer.step():
                f.write('"dropped"\n')              # the line above does not count
                f.flush()
            time.sleep(pause)
    out = {**r.summary(), "position": data.position}
    r.shutdown()
    return out


def _logged(log_dir: Path) -> dict[tuple[int, int], list[dict]]:
    out = {}
    for p in sorted(log_dir.glob("ids.replica*.jsonl")):
        replica, attempt = map(int, re.fullmatch(r"ids\.replica(\d+)\.attempt(\d+)\.jsonl",
                                                 p.name).groups())
        entries = []
        for line in p.read_text().split("\n")[:-1]:          # whole lines
            entry = json.loads(line)
            if entry == "dropped":
                entries.pop()
            else:
                entries.append(entry)
        out[(replica, attempt)] = entries
    return out


ROWS, STEPS = 50, 70           # 6 rows a step: 420 rows, 8.4 epochs of the 50-row table


@pytest.mark.slow
def test_2_groups_to_1_and_back_to_2_train_each_committed_sample_of_the_stream_once(
        tmp_path, gpulaunch_home):
    pytest.importorskip("torchft")
    from gpulaunch import ft
    from gpulaunch.ft.result import read_steps
    path = _table(tmp_path / "table", ROWS)
    logs = tmp_path / "logs"
    logs.mkdir()
    capacity = ft.Capacity(2)
    ev = {}

    def node_watcher(groups):
        mine = read_steps(groups.ft_dir, 0)
        step = mine[-1]["step"] if mine else 0
        if "lost" not in ev and step >= 12:
            capacity.take()                        # node 1 is gone, not replaced ...
            ev["pids"] = ft.group_pids(groups.ft_dir, 1, 0)
            for pid in ev["pids"]:
                os.kill(pid, signal.SIGKILL)       # ... with its process
            ev["lost"] = step
        elif "lost" in ev and "back" not in ev and groups.size_changes \
                and step >= groups.size_changes[0].step + 8:
            ev["back"] = step                      # 8 steps on one group: capacity returns
            capacity.give()

    result = ft.run_replicas(_train_on_data, STEPS, path, str(logs), 0.03, replicas=(1, 2),
                             node_lost_timeout=1.0, capacity=capacity,
                             ft_dir=str(tmp_path / "ft"), on_poll=node_watcher)
    changes = [(c.from_size, c.to_size, c.replica) for c in result.size_changes]
    assert changes == [(2, 1, 1), (1, 2, 1)], result.summary()
    assert not alive(ev["pids"])
    logged = _logged(logs)
    assert set(logged) == {(0, 0), (1, 0), (1, 1)}, sorted(logged)
    # group 0 never stopped: it committed every step of the run, the only lineage there is
    survivor = logged[(0, 0)]
    assert [e["step"] for e in survivor] == list(range(1, STEPS + 1))
    sizes = {e["step"]: e["n"] for e in survivor}
    assert set(sizes.values()) == {1, 2} and sizes[1] == 2 and sizes[STEPS] == 2
    committed = Counter()
    for step in range(1, STEPS + 1):
        # every group whose gradient counted in this step of group 0's. The killed group's last
        # entry is undecided (it died before it knew): if group 0 committed that step with the
        # same live groups, its all-reduce got the killed group's gradient, so those rows are
        # in the update; if group 0 dropped it and redid it alone, its n differs.
        mine = [e for entries in logged.values() for e in entries
                if e["step"] == step and e["n"] == sizes[step]]
        assert 1 <= len([e for e in mine if e["ids"]]) <= sizes[step], (step, mine)
        ids = sum((e["ids"] for e in mine), [])
        rows = sorted(tuple(r) for e in mine for r in e["rows"])
        assert rows == [(6 * (step - 1), 6 * step - 3), (6 * step - 3, 6 * step)], (step, rows)
        assert sorted(ids) == sorted(_stream_ids(path, 6 * (step - 1), 6 * step)), step
        committed.update(ids)
    # the whole run: the stream's first 420 positions, each sample as often as they hold it
    assert committed == Counter(_stream_ids(path, 0, 6 * STEPS))
    assert set(committed.values()) == {8, 9}       # 8.4 epochs: each id 8 or 9 times
    # after the shrink group 0 trained both shards alone; the returning group healed and went
    # on from the run's position, not from its own start
    shrink, grow = result.size_changes
    alone = [e for e in survivor if e["n"] == 1]
    assert len(alone) >= 8 and all(len(e["ids"]) == 6 for e in alone)
    healed, *back = logged[(1, 1)]           # its first commit healed: its rows did not count
    assert healed["ids"] == [] and healed["n"] == 1 and healed["step"] == grow.step
    assert back[0]["n"] == 2 and back[0]["rows"][0][0] >= 6 * shrink.step
    assert {o[0]["position"] for o in result.results.values()} == {6 * STEPS}
