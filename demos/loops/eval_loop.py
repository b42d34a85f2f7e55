"""Train --steps steps; every 10 steps an evaluation pass of several no_grad forwards.

The evaluation must not count as (or inflate) training steps. --manual: manual SGD updates
instead of an optimizer (steps then end at the next data/forward after a backward).
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

EVAL_EVERY = 10


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--eval-batch-size", type=int, default=256)
    p.add_argument("--manual", action="store_true")
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.batch_size * 8, 32)
    train = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=args.batch_size, shuffle=True,
                       drop_last=True)
    xv = torch.randn(args.eval_batch_size * args.eval_batches, 32)
    val = DataLoader(TensorDataset(xv, xv.sum(1, keepdim=True)), batch_size=args.eval_batch_size)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = None if args.manual else torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = evals = 0
    eval_s = 0.0
    t0 = time.perf_counter()
    while step < args.steps:
        for xb, yb in train:
            model.train()
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    for p_ in model.parameters():
                        p_ -= 1e-3 * p_.grad
                        p_.grad = None
            step += 1
            if step % EVAL_EVERY == 0:
                te = time.perf_counter()
                model.eval()
                with torch.no_grad():
                    val_loss = sum(nn.functional.mse_loss(model(a), b).item() for a, b in val)
                evals += 1
                eval_s += time.perf_counter() - te
                print(f"step {step} val_loss {val_loss:.4f}", flush=True)
            if step >= args.steps:
                break
    loop_s = time.perf_counter() - t0
    print(f"done steps={step} evals={evals} loop_s={loop_s:.6f} eval_s={eval_s:.6f}")


if __name__ == "__main__":
    main()
