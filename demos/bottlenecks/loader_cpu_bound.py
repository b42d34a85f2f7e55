"""CPU-bound preprocessing: DataLoader workers busy with pure-Python work saturate the host's CPUs."""

import os

import torch
from _common import args, mlp
from torch.utils.data import DataLoader, Dataset


class HeavyDataset(Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        acc = 0
        for k in range(30000):  # "augmentation" in pure Python: far slower than a training step
            acc += (k * i) % 7
        return torch.full((128,), float(acc % 3)), torch.randn(1)


if __name__ == "__main__":
    a = args(80)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    workers = 2 * (os.cpu_count() or 2)  # more workers than CPUs: they fill the host even beside another job
    loader = DataLoader(HeavyDataset(), batch_size=32, num_workers=workers, persistent_workers=True)
    step = 0
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step >= a.steps:
            break
    print("done", step)
