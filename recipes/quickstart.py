# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # gpulaunch quickstart
#
# One decorator runs a Python function on every GPU of this machine, one process per GPU,
# and hands back each rank's return value. On a machine without a GPU (a laptop, CI) the
# same code runs on CPU worker processes with the gloo backend.
#
# Run it as a script (`python recipes/quickstart.py`) or open it as a notebook.

# %%
from gpulaunch import distributed, hardware
from gpulaunch import runtime as rt

print("This machine:", hardware.detect().describe())

# %% [markdown]
# ## Hello, ranks
# Each rank returns its global rank; `.distributed()` returns them in rank order.

# %%
@distributed()  # every GPU here (2 CPU worker processes when there is none)
def hello_world(name: str) -> int:
    import socket
    print(f"hello {name} from rank {rt.get_global_rank()} of {rt.get_world_size()} "
          f"on {socket.gethostname()}")
    return rt.get_global_rank()


ranks = hello_world.distributed("gpulaunch")
print("ranks:", ranks)

# %% [markdown]
# ## A 20-line DDP training loop
# `rt.init()` creates the process group (NCCL on GPUs, gloo on CPU) and returns this rank's
# device. Each rank draws its own data; DDP averages the gradients.

# %%
@distributed()
def train(steps: int = 60, lr: float = 0.05) -> float:
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = rt.init()
    torch.manual_seed(0)  # same initial weights on every rank
    net = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1000 + rt.get_global_rank())  # different data per rank
    w_true = torch.linspace(-1, 1, 10)
    for step in range(steps):
        x = torch.randn(64, 10, generator=gen)
        y = x @ w_true + 0.01 * torch.randn(64, generator=gen)
        loss = nn.functional.mse_loss(model(x.to(device)).squeeze(-1), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0 or step == steps - 1:
            rt.print0(f"step {step:3d}  loss {loss.item():.4f}")
    return loss.item()


final_losses = train.distributed()
print("final loss on each rank:", [round(v, 4) for v in final_losses])
