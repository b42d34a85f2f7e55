"""DDP training the way the PyTorch DDP tutorial writes it: torchrun sets the environment, gloo on CPU
(nccl on GPUs), a DistributedSampler, DDP around the model. Synthetic data.

    torchrun --nproc-per-node 2 demos/ddp/train_ddp.py --steps 40
    perfmon torchrun --nproc-per-node 2 demos/ddp/train_ddp.py --steps 40
    ... --slow-rank 1 --delay 0.02     rank 1's data loading sleeps: a straggler
    ... --fail-rank 1 --fail-at 5      rank 1 raises at step 5: torchrun takes the job down
    torchrun ... demos/ddp/train_ddp.py --instrument   no perfmon launcher: each rank calls perfmon.instrument()
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Synthetic(Dataset):
    def __init__(self, n: int, delay: float) -> None:
        self.x = torch.randn(n, 64)
        self.y = torch.randint(0, 10, (n,))
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        return self.x[i], self.y[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay", type=float, default=0.0, help="seconds per batch on the slow rank")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-at", type=int, default=5)
    p.add_argument("--instrument", action="store_true", help="start perfmon's agent here (perfmon attach/ls)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps (a slow job to attach to)")
    args = p.parse_args()
    if args.instrument:
        import perfmon

        perfmon.instrument()

    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    delay = args.delay / args.batch if rank == args.slow_rank else 0.0
    data = Synthetic(args.steps * args.batch * world, delay)
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, world, rank))
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    steps = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        if rank == args.fail_rank and steps == args.fail_at:
            raise RuntimeError(f"rank {rank} failed at step {steps}")
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        steps += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
    print(f"rank {rank}/{world}: {steps} steps, loss {loss.item():.3f}", flush=True)
    # DDP's reducer keeps the process group in a reference cycle. Left to the interpreter's exit, gloo's
    # threads are torn down after Python's and the rank can abort ("terminate called without an active
    # exception", SIGABRT; torch 2.13 on a loaded host, about 1 run in 6). Freed first, it never did in 40.
    del model, opt, loader
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
