"""Input-bound: each sample costs 0.3 ms of (fake) decoding in the main process (num_workers=0)."""

import time

import torch
from _common import args, mlp
from torch.utils.data import DataLoader, Dataset


class SlowDataset(Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        time.sleep(0.0003)  # decoding / augmentation
        return torch.randn(128), torch.randn(1)


a = args(120)
model = mlp()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(SlowDataset(), batch_size=32, num_workers=0)
step = 0
while step < a.steps:
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step >= a.steps:
            break
print("done", step)
