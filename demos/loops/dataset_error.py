"""A Dataset that fails on one sample: the traceback must be the one plain python prints (no perfmon frame)."""

import torch
from torch.utils.data import DataLoader, Dataset


class Flaky(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 9:
            raise ValueError(f"corrupt sample {i}")
        return torch.zeros(4)


model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x in DataLoader(Flaky(), batch_size=2):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
