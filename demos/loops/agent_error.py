"""Sabotages perfmon's agent from inside (its publisher raises) to show training is not affected."""

import torch
from torch import nn

from perfmon import _api

agent = _api.get_agent()
if agent is not None:
    def broken(*args, **kwargs):
        raise RuntimeError("injected agent failure")

    agent.cuda.resolve = broken  # every publisher tick now fails inside the agent

model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(200):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("training finished")
