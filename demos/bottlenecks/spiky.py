"""Periodic spikes: every 15th step also "saves a checkpoint" (60 ms of blocking work)."""

import time

import torch
from _common import args, mlp

a = args(160)
model = mlp()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(1, a.steps + 1):
    x, y = torch.randn(64, 128), torch.randn(64, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 15 == 0:
        time.sleep(0.06)  # torch.save(model.state_dict(), ...) on a slow disk
print("done")
