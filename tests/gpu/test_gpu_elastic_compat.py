"""torchelastic's private names that the node agent relies on, on the GPU host's torch (2.11
when this was written; CI checks torch 2.14 in tests/launch/test_elastic_compat.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(60)
def test_private_api_present_on_this_torch():
    import torch

    from gpulaunch.backends.local.elastic_compat import missing_private_api
    assert missing_private_api() == [], torch.__version__
