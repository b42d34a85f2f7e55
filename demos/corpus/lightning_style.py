"""PyTorch Lightning's automatic optimization, written out (lightning/pytorch/loops/optimization/automatic.py
shape): every step is ``optimizer.step(closure=closure)``, where ``closure`` is a callable object that runs the
module's ``training_step`` (the loss and its logged metrics), the ``on_before_zero_grad`` hook, ``zero_grad`` and
the backward, and keeps the result for the loop to consume; an LR scheduler steps after each optimizer step; a
validation loop runs every ``--val-every`` steps and a checkpoint is saved at the end of each epoch."""

import argparse
import csv
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class LitClassifier(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, classes))
        self.logged: dict[str, float] = {}

    def forward(self, x):
        return self.net(x)

    def log(self, name, value):  # LightningModule.log: detached, reduced when the logger flushes
        self.logged[name] = value.detach()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)  # Lightning calls the submodules, not the module's own __call__
        loss = nn.functional.cross_entropy(logits, y)
        # metrics a torchmetrics-style logger computes every step
        probs = logits.detach().softmax(-1)
        self.log("train_loss", loss)
        self.log("train_acc", (probs.argmax(-1) == y).float().mean())
        self.log("entropy", -(probs * probs.clamp_min(1e-9).log()).sum(-1).mean())
        confusion = torch.bincount(y * probs.shape[1] + probs.argmax(-1), minlength=probs.shape[1] ** 2)
        self.log("confusion_diag", confusion.view(probs.shape[1], -1).diagonal().sum())
        calib = torch.histc(probs.max(-1).values, bins=15, min=0, max=1)  # a calibration histogram
        self.log("calib_max", calib.max())
        return loss

    @torch.no_grad()
    def validation_step(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)


class Closure:
    """lightning's ``Closure``: called by ``optimizer.step``; its result is consumed after the step."""

    def __init__(self, step_fn, zero_grad_fn, backward_fn):
        self._step_fn, self._zero_grad_fn, self._backward_fn = step_fn, zero_grad_fn, backward_fn
        self._result = None
        self.calls = 0

    def __call__(self):
        self.calls += 1
        loss = self._step_fn()
        self._zero_grad_fn()
        self._backward_fn(loss)
        self._result = loss.detach()
        return loss

    def consume_result(self):
        result, self._result = self._result, None
        return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--steps-per-epoch", type=int, default=12)
    parser.add_argument("--val-every", type=int, default=8)
    parser.add_argument("--out", default="corpus-out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    n = args.steps_per_epoch * 256
    train = DataLoader(TensorDataset(torch.randn(n, 32), torch.randint(0, 10, (n,))), batch_size=256, shuffle=True)
    val = DataLoader(TensorDataset(torch.randn(512, 32), torch.randint(0, 10, (512,))), batch_size=256)
    module = LitClassifier()
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    truth = {"steps": 0, "closure_calls": 0, "val_batches": 0, "files": []}
    metrics_path = os.path.join(args.out, "metrics.csv")
    with open(metrics_path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["step", "train_loss", "train_acc"])
        epoch = 0
        while truth["steps"] < args.steps:
            for batch_idx, batch in enumerate(train):
                closure = Closure(lambda b=batch, i=batch_idx: module.training_step(b, i),
                                  lambda: optimizer.zero_grad(set_to_none=True), lambda loss: loss.backward())
                optimizer.step(closure=closure)
                loss = closure.consume_result()
                truth["closure_calls"] += closure.calls
                scheduler.step()
                truth["steps"] += 1
                writer.writerow([truth["steps"], f"{loss.item():.4f}", f"{module.logged['train_acc'].item():.4f}"])
                if truth["steps"] % args.val_every == 0:
                    losses = []
                    for vb in val:
                        losses.append(module.validation_step(vb))
                        truth["val_batches"] += 1
                    print(f"step {truth['steps']}: val_loss {torch.stack(losses).mean().item():.4f}")
                if truth["steps"] >= args.steps:
                    break
            path = os.path.join(args.out, f"epoch={epoch}.ckpt")
            torch.save({"state_dict": module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)
            truth["files"].append(os.path.basename(path))
            epoch += 1
    truth["files"] = sorted([*truth["files"], "metrics.csv"])
    print("GROUND_TRUTH " + json.dumps(truth))


if __name__ == "__main__":
    main()
