"""What a rank returns reaches the caller as it was, in CPU tensors (real launches, 2 CPU
ranks). The CUDA half of the same path (CUDA tensors arrive as CPU tensors and the caller never
initialises CUDA) runs in tests/gpu/test_gpu_launch.py on the GPU host: on CPU there is no
non-CPU device to move from, so here the tests cover the containers and the autograd cases."""

from __future__ import annotations

import collections
import dataclasses

import torch

from gpulaunch import distributed
from gpulaunch import runtime as rt

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Summary:
    loss: torch.Tensor
    extras: dict


def _train_step():
    torch.manual_seed(rt.get_global_rank())
    model = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    loss = model(x).pow(2).mean()          # non-leaf, requires grad: torch refuses to pickle it
    loss.backward()
    return Summary(loss=loss, extras={"pair": Pair(model.weight, [model.bias.grad]),
                                      "state": model.state_dict(), "rank": rt.get_global_rank()})


def test_nested_tensors_arrive_detached_on_cpu_in_their_containers(gpulaunch_home):
    out = distributed(gpus=2, stream_logs="none")(_train_step).distributed()
    assert [s.extras["rank"] for s in out] == [0, 1]
    for s in out:
        assert isinstance(s, Summary) and isinstance(s.extras["pair"], Pair)
        assert s.loss.device.type == "cpu" and not s.loss.requires_grad
        assert s.loss.grad_fn is None and s.loss.item() > 0
        weight = s.extras["pair"].a
        assert isinstance(weight, torch.nn.Parameter)           # a leaf keeps its type
        assert torch.equal(weight.detach(), s.extras["state"]["weight"])
        assert s.extras["pair"].b[0].shape == (2,)
    assert not torch.equal(out[0].extras["state"]["weight"], out[1].extras["state"]["weight"])
