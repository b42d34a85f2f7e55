"""GradScaler with skipped steps, the Hugging Face Trainer / accelerate way: scaler.step() skips
optimizer.step() when the gradients hold inf/nan, detected by the scale going down in update(); the lr
scheduler only steps when the optimizer did. --inf-every K: every K-th iteration's loss is multiplied by
inf, so its gradients overflow (a stand-in for a real fp16 overflow)."""

import argparse
import json

import torch
from torch import nn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--inf-every", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=args.steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    assert scaler.is_enabled()
    truth = {"steps": 0, "skipped_steps": 0, "optimizer_steps": 0}
    for it in range(args.steps):
        xb = torch.randn(args.batch_size, 32)
        yb = xb.pow(2).sum(1, keepdim=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(xb).float(), yb)
        tr_loss = loss.item()
        if args.inf_every and it % args.inf_every == args.inf_every - 1:
            loss = loss * float("inf")  # overflow: every gradient becomes inf/nan
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        optimizer_was_run = scale_before <= scaler.get_scale()
        if optimizer_was_run:
            lr_scheduler.step()
            truth["optimizer_steps"] += 1
        else:
            truth["skipped_steps"] += 1
            print(f"iteration {it}: gradient overflow, skipping step; scale now {scaler.get_scale()}")
        optimizer.zero_grad(set_to_none=True)
        truth["steps"] += 1
    print(f"final loss {tr_loss:.4f} lr {lr_scheduler.get_last_lr()[0]:.6f}")
    print("GROUND_TRUTH " + json.dumps(truth, sort_keys=True))


if __name__ == "__main__":
    main()
