"""Memory creep: the loop keeps every step's activations alive (history.append(loss) without .item())."""

import torch
from _common import args

a = args(300)
torch.manual_seed(0)
w = torch.randn(512, 512, requires_grad=True)
opt = torch.optim.SGD([w], lr=1e-4)
history = []
for _ in range(a.steps):
    x = torch.randn(1024, 512)
    out = torch.tanh(x @ w)
    loss = out.pow(2).mean()
    opt.zero_grad()
    loss.backward(retain_graph=False)
    opt.step()
    history.append(out)  # the bug: keeps a 2 MiB tensor per step (use loss.item() instead)
print("done", len(history))
