"""DDP the way the PyTorch DDP tutorial starts it: ``mp.spawn(train, args=(world_size,), nprocs=world_size)`` from
the script itself, no torchrun; gloo on CPU, a DistributedSampler, DDP around the model. Synthetic data.

    python demos/ddp/spawn_ddp.py --steps 40
    perfmon demos/ddp/spawn_ddp.py --steps 40      every spawned rank followed, as under perfmon torchrun
"""

from __future__ import annotations

import argparse
import gc
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def train(rank: int, world: int, steps: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(steps * 16 * world, 64), torch.randint(0, 10, (steps * 16 * world,)))
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, world, rank))
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    count = 0
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        count += 1
    print(f"rank {rank}/{world}: {count} steps, loss {loss.item():.3f}", flush=True)
    del model, opt, loader  # gloo's threads must go before the interpreter's (see train_ddp.py)
    gc.collect()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    mp.spawn(train, args=(args.world, args.steps, free_port()), nprocs=args.world, join=True)
