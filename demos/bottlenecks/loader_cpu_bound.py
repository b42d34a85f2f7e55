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
    # The training process computes on one thread, as its workers do: with more workers than CPUs, intra-op
    # threads in the trainer would spin against them and make the model's own compute the slow part.
    torch.set_num_threads(1)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    workers = 3 * (os.cpu_count() or 2)  # more workers than CPUs: they fill most of the host even beside another job
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
