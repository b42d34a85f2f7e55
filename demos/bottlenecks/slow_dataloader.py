"""Input-bound: each sample costs 0.3 ms of (fake) decoding in the main process (num_workers=0)."""

import torch
from _common import SlowDataset, args, mlp
from torch.utils.data import DataLoader

a = args(120)
model = mlp()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(SlowDataset(0.0003), batch_size=32, num_workers=0)
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
