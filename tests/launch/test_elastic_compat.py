"""torchelastic's private API that the node agent builds on (``backends/local/elastic_compat``)
is present in the installed torch. CI runs this on torch 2.14; the GPU suite runs it on the GPU
host's torch (2.11), so a torch upgrade that moves one of these names fails here, by name,
before any launch misbehaves."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from gpulaunch.backends.local import elastic_compat
from gpulaunch.common.records import RankExit

pytestmark = pytest.mark.unit


def test_every_private_name_the_agent_uses_exists_in_this_torch():
    assert elastic_compat.missing_private_api() == [], torch.__version__


def test_torchelastic_failures_become_typed_rank_exits(tmp_path):
    error_file = str(tmp_path / "error.json")       # absent: a rank that died without writing
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=-9, error_file=error_file)
    exits = elastic_compat.exits_from({3: failure})
    assert exits == {3: RankExit(rank=3, exitcode=-9, local_rank=1, pid=4242,
                                 timestamp=failure.timestamp, message=str(failure.message))}
    assert RankExit.from_data(exits[3].to_data()) == exits[3]
