"""A healthy loop: data in memory, a model big enough that the loader is a small share, steady steps.
perfmon should raise no warning here."""

import torch
from _common import args
from torch.utils.data import DataLoader, TensorDataset

a = args()
# One compute thread: steady steps even when another job shares the CPUs (intra-op threads waiting on each
# other at every op would make a busy machine look like an unstable loop).
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = TensorDataset(torch.randn(4096, 256), torch.randn(4096, 1))
# ~30 ms steps: long enough that a busy host's preemptions (a few ms each) average out within a step instead of
# doubling a few short ones (p99 over p50 is what step-instability reads)
loader = DataLoader(data, batch_size=256, shuffle=True)
step = 0
while step < a.steps:
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step >= a.steps:
            break
print("done", step)
