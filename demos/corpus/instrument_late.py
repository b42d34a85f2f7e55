"""perfmon.instrument() called late: the model and its optimizer exist before the agent starts (the
way a user adds monitoring to an existing script: after setup, just before the loop). Without
perfmon installed the script trains all the same."""

import argparse
import json

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.batch_size * 5, 32)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=args.batch_size, shuffle=True,
                        drop_last=True)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    try:
        import perfmon

        perfmon.instrument()
    except ImportError:  # monitoring is optional
        pass
    step = 0
    while step < args.steps:
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.steps:
                break
    print(f"final loss {loss.item():.4f}")
    print("GROUND_TRUTH " + json.dumps({"steps": step, "samples": step * args.batch_size}, sort_keys=True))


if __name__ == "__main__":
    main()
