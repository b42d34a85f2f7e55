"""A loop that logs its own MFU, as torchtitan-style trainers do: every --count-every steps the whole step (forward,
backward, optimizer) runs under torch.utils.flop_counter.FlopCounterMode, and the count gives the achieved FLOP/s.
No DataLoader: batches are made in the loop (nanoGPT's get_batch way)."""

import argparse
import json
import sys
import time

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--count-every", type=int, default=4, help="1: every step runs under the script's counter")
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    truth = {"steps": 0, "counted": 0, "flops_per_step": None}

    def get_batch():
        return torch.randn(args.batch_size, 64), torch.randint(0, 10, (args.batch_size,))

    def train_step(x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    counts = set()
    for it in range(args.steps):
        x, y = get_batch()
        t0 = time.perf_counter()
        if it % args.count_every == 1 % args.count_every:
            with FlopCounterMode(display=False) as counter:
                loss = train_step(x, y)
            flops = counter.get_total_flops()
            counts.add(flops)
            truth["counted"] += 1
            achieved = flops / max(time.perf_counter() - t0, 1e-9)  # what the script logs (not printed: it varies)
            if truth["counted"] == 1:
                print(f"iter {it}: loss {loss.item():.4f}, {flops:,} FLOPs a step ({achieved > 0})")
        else:
            loss = train_step(x, y)
        truth["steps"] += 1
    truth["flops_per_step"] = counts.pop() if len(counts) == 1 else sorted(counts)
    print(f"final loss {loss.item():.4f}")
    print("GROUND_TRUTH " + json.dumps(truth, sort_keys=True))
    sys.exit(0 if isinstance(truth["flops_per_step"], int) and truth["flops_per_step"] > 0 else 3)


if __name__ == "__main__":
    main()
