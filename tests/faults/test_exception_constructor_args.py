"""An exception whose ``__init__`` takes other positional arguments than it passes to
``Exception`` (``MyErr(code, msg)``) comes back to the caller as itself, cold and warm."""

from __future__ import annotations

import pytest

import gpulaunch
from gpulaunch import distributed


class MyErr(Exception):
    def __init__(self, code, msg):
        super().__init__(msg)
        self.code = code


def fails():
    from gpulaunch import runtime as rt
    if rt.get_global_rank() == 1:
        raise MyErr(7, "bad input on rank 1")
    return 0


@pytest.mark.parametrize("keep_alive", [False, 30], ids=["cold", "warm"])
def test_exception_with_positional_constructor_args_comes_back_as_itself(keep_alive):
    fn = distributed(gpus=2, keep_alive=keep_alive, stream_logs="none")(fails)
    try:
        with pytest.raises(MyErr) as info:
            fn.distributed()
    finally:
        gpulaunch.shutdown()
    assert info.value.code == 7 and str(info.value) == "bad input on rank 1"
    assert info.value.rank == 1


def test_rebuilt_by_state_without_a_process():
    import cloudpickle

    from gpulaunch.common.payload import exception_record
    try:
        raise MyErr(3, "x")
    except MyErr as e:
        record = exception_record(e, rank=0, host="h")
    back = cloudpickle.loads(record.exception)
    assert type(back) is MyErr and back.code == 3 and back.args == ("x",)
