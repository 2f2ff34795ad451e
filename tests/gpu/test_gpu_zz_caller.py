"""Last in the suite: this test process launched every run above (tracked ones too) and read
their results, and it still has no CUDA context of its own."""

from __future__ import annotations

import os

import pytest

from .helpers import compute_apps

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(30)
def test_the_suites_own_process_never_initialised_cuda():
    import torch
    assert not torch.cuda.is_initialized(), "the test process (the caller) initialised CUDA"
    apps = compute_apps()
    assert os.getpid() not in apps, f"the caller holds a CUDA context: {apps}"
