"""The model handed to a spawn-context child process as a Process argument (pickled), the way async
evaluation / checkpoint-export workers receive it: train a few steps, spawn a child that computes a
forward and returns it through a Queue, train a few more steps."""

import argparse
import json
import multiprocessing as mp

import torch
from torch import nn


def evaluate_in_child(model, x, queue):
    torch.set_num_threads(1)
    model.eval()
    with torch.no_grad():
        queue.put(model(x).tolist())  # plain values: a shared-memory tensor would outlive its sender


def train_steps(model, optimizer, n, batch_size):
    for _ in range(n):
        xb = torch.randn(batch_size, 16)
        loss = nn.functional.mse_loss(model(xb), xb.sum(1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8, help="half before the child process, half after")
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    before = args.steps // 2
    loss = train_steps(model, optimizer, before, args.batch_size)
    print(f"trained {before} steps, loss {loss:.4f}")

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    x = torch.randn(4, 16)
    proc = ctx.Process(target=evaluate_in_child, args=(model, x, queue))
    proc.start()
    child_out = queue.get(timeout=120)
    proc.join()
    model.eval()
    with torch.no_grad():
        same = torch.allclose(torch.tensor(child_out), model(x))
    model.train()
    print(f"child exit code {proc.exitcode}, child forward matches parent: {same}")

    loss = train_steps(model, optimizer, args.steps - before, args.batch_size)
    print(f"trained {args.steps - before} more steps, loss {loss:.4f}")
    truth = {"steps": args.steps, "child_processes": 1, "child_exitcode": proc.exitcode, "child_match": same}
    print("GROUND_TRUTH " + json.dumps(truth, sort_keys=True))


if __name__ == "__main__":
    main()
