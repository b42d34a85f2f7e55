"""A training loop the automatic hooks cannot see, instrumented with perfmon's explicit API.

No DataLoader, no nn.Module, no optimizer, no ``.backward()``: a hand-rolled batch generator,
a functional two-layer MLP on plain tensors, gradients from ``torch.autograd.grad`` and manual
SGD updates. ``perfmon.phase`` and ``perfmon.step`` mark the phases and the step ends; without
perfmon (``python demos/custom_loop.py``) they do nothing.

    perfmon demos/custom_loop.py --steps 300
"""

import argparse

import torch
import torch.nn.functional as F

import perfmon


def batches(n_features: int, batch_size: int, seed: int = 0):
    """Endless synthetic regression batches (y = x @ w_true + noise)."""
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(n_features, 1, generator=g)
    while True:
        x = torch.randn(batch_size, n_features, generator=g)
        y = x @ w_true + 0.1 * torch.randn(batch_size, 1, generator=g)
        yield x, y


def init_params(n_features: int, hidden: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shapes = [(n_features, hidden), (hidden,), (hidden, 1), (1,)]
    params = [torch.randn(*s, generator=g) * (0.1 if len(s) == 2 else 0.0) for s in shapes]
    return [p.requires_grad_() for p in params]


def forward(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = params
    return F.relu(x @ w1 + b1) @ w2 + b2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args()

    torch.manual_seed(0)
    params = init_params(args.features, args.hidden)
    data = batches(args.features, args.batch_size)
    loss = torch.tensor(0.0)
    for step in range(1, args.steps + 1):
        with perfmon.phase("data"):
            x, y = next(data)
        with perfmon.phase("forward"):
            loss = F.mse_loss(forward(params, x), y)
        with perfmon.phase("backward"):
            grads = torch.autograd.grad(loss, params)
        with perfmon.phase("optimizer"):
            with torch.no_grad():
                for param, grad in zip(params, grads, strict=True):
                    param.sub_(args.lr * grad)
        perfmon.step()
        if step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    print(f"done steps={args.steps} loss={loss.item():.4f}")


if __name__ == "__main__":
    main()
