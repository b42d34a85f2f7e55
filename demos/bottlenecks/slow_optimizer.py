"""Slow optimizer: 400 small parameter tensors updated one by one (Adam with foreach=False)."""

import torch
from _common import args
from torch import nn


class ManyParams(nn.Module):
    def __init__(self, n: int = 400) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(16)) for _ in range(n)])

    def forward(self, x):
        return x @ torch.stack(list(self.ps)).sum(0)


a = args(120)
torch.manual_seed(0)
model = ManyParams()
opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
for _ in range(a.steps):
    x = torch.randn(64, 16)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("done")
