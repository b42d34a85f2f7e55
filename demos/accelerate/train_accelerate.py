"""A Hugging Face accelerate training loop, as its examples write one: Accelerator, prepare, accelerator.backward,
evaluation gathered across processes, the unwrapped model saved by the main process. Synthetic data.

    accelerate launch --cpu demos/accelerate/train_accelerate.py --epochs 2
    perfmon accelerate launch --cpu demos/accelerate/train_accelerate.py --epochs 2
    perfmon accelerate launch --multi_gpu --num_processes 2 demos/accelerate/train_accelerate.py
    ACCELERATE_USE_CPU=true perfmon accelerate launch --multi_gpu --num_processes 2 ...   (gloo ranks on a CPU)
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--fail-at", type=int, default=0, help="raise at this step (a crashing job)")
    ap.add_argument("--save", default="", help="where the main process saves the trained weights")
    args = ap.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train = TensorDataset(torch.randn(1024, 32), torch.randint(0, 4, (1024,)))
    valid = TensorDataset(torch.randn(256, 32), torch.randint(0, 4, (256,)))
    train_dl = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    valid_dl = DataLoader(valid, batch_size=64)
    model, optimizer, train_dl, valid_dl = accelerator.prepare(model, optimizer, train_dl, valid_dl)
    criterion = nn.CrossEntropyLoss()

    steps = 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_dl:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            steps += 1
            if steps == args.fail_at:
                raise RuntimeError(f"failing at step {steps} as asked")
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in valid_dl:
                pred, y = accelerator.gather_for_metrics((model(x).argmax(-1), y))
                correct += int((pred == y).sum())
                total += y.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.3f}")
    if args.save and accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), args.save)
    print(f"process {accelerator.process_index}/{accelerator.num_processes}: {steps} steps", flush=True)


if __name__ == "__main__":
    main()
