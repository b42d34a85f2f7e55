"""timm train.py shape: channels_last CNN, bf16 autocast + GradScaler (NativeScaler), ModelEmaV3-style
EMA updated every step, an EMA validation pass after every epoch, CheckpointSaver-style files at the end
(a whole-model torch.save and a state_dict checkpoint), then reload/pickle/deepcopy of the model."""

import argparse
import copy
import csv
import json
import os
import pickle
import shutil
from collections import OrderedDict
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ConvBnAct(nn.Sequential):
    def __init__(self, cin, cout, stride=1):
        super().__init__(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class TinyResNet(nn.Module):
    def __init__(self, num_classes=10, width=16):
        super().__init__()
        self.stem = ConvBnAct(3, width)
        self.stages = nn.Sequential(ConvBnAct(width, width * 2, 2), ConvBnAct(width * 2, width * 2))
        self.head = nn.Linear(width * 2, num_classes)

    def forward_features(self, x):
        return self.stages(self.stem(x))

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.forward_features(x), 1).flatten(1))


class ModelEmaV3(nn.Module):
    def __init__(self, model, decay=0.99):
        super().__init__()
        self.module = copy.deepcopy(model).eval()  # timm: a frozen copy of the model being trained
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values(), strict=True):
            if ema_v.is_floating_point():
                ema_v.lerp_(model_v.to(dtype=ema_v.dtype), weight=1.0 - self.decay)
            else:
                ema_v.copy_(model_v)

    def forward(self, x):
        return self.module(x)


class NativeScaler:  # timm.utils.NativeScaler
    state_dict_key = "amp_scaler"

    def __init__(self, device="cpu"):
        try:
            self._scaler = torch.amp.GradScaler(device)
        except (AttributeError, TypeError, RuntimeError):  # older torch: no CPU GradScaler
            self._scaler = None

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None):
        if self._scaler is None:
            loss.backward()
            if clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            optimizer.step()
            return False
        scale = self._scaler.get_scale()
        self._scaler.scale(loss).backward()
        if clip_grad is not None:
            self._scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        self._scaler.step(optimizer)
        self._scaler.update()
        return self._scaler.get_scale() < scale  # True: inf/nan grads, optimizer.step() was skipped

    def state_dict(self):
        return self._scaler.state_dict() if self._scaler is not None else {}


def validate(model, loader, loss_fn, amp_autocast):
    model.eval()
    loss_sum, correct, n, batches = 0.0, 0, 0, 0
    with torch.no_grad():
        for input, target in loader:
            input = input.contiguous(memory_format=torch.channels_last)
            with amp_autocast():
                output = model(input)
            loss_sum += loss_fn(output.float(), target).item() * input.size(0)
            correct += (output.argmax(1) == target).sum().item()
            n, batches = n + input.size(0), batches + 1
    return OrderedDict([("loss", loss_sum / n), ("top1", 100.0 * correct / n), ("batches", batches)])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps-per-epoch", type=int, default=4)
    p.add_argument("--val-batches", type=int, default=3)
    p.add_argument("--out", default="corpus-out")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(42)

    def synthetic(n):
        return TensorDataset(torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,)))

    loader_train = DataLoader(synthetic(args.batch_size * args.steps_per_epoch), batch_size=args.batch_size,
                              shuffle=True, drop_last=True)
    loader_eval = DataLoader(synthetic(args.batch_size * args.val_batches), batch_size=args.batch_size)
    model = TinyResNet().to(memory_format=torch.channels_last)
    model_ema = ModelEmaV3(model, decay=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True)
    loss_scaler = NativeScaler("cpu")
    amp_autocast = partial(torch.autocast, device_type="cpu", dtype=torch.bfloat16) if loss_scaler._scaler else nullcontext
    train_loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    num_epochs = -(-args.steps // args.steps_per_epoch)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    os.makedirs(args.out, exist_ok=True)
    truth = {"steps": 0, "skipped_steps": 0, "evals": 0, "eval_batches": 0, "ema_updates": 0}
    rows = []
    for epoch in range(num_epochs):
        model.train()
        for input, target in loader_train:
            if truth["steps"] == args.steps:
                break
            input = input.contiguous(memory_format=torch.channels_last)
            with amp_autocast():
                output = model(input)
                loss = train_loss_fn(output, target)
            optimizer.zero_grad()
            truth["skipped_steps"] += loss_scaler(loss, optimizer, clip_grad=5.0, parameters=model.parameters())
            model_ema.update(model)
            truth["steps"], truth["ema_updates"] = truth["steps"] + 1, truth["ema_updates"] + 1
            lr_scheduler.step()
        ema_metrics = validate(model_ema, loader_eval, nn.CrossEntropyLoss(), amp_autocast)
        truth["evals"], truth["eval_batches"] = truth["evals"] + 1, truth["eval_batches"] + ema_metrics["batches"]
        print(f"Train: {epoch} loss: {loss.item():.4f} | Test (EMA): loss {ema_metrics['loss']:.4f} "
              f"top1 {ema_metrics['top1']:.2f}")
        rows.append({"epoch": epoch, "train_loss": round(loss.item(), 4), "eval_loss": round(ema_metrics["loss"], 4)})
    with open(os.path.join(args.out, "summary.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    checkpoint = os.path.join(args.out, f"checkpoint-{num_epochs - 1}.pth.tar")
    torch.save({"epoch": num_epochs - 1, "arch": "tinyresnet", "state_dict": model.state_dict(),
                "state_dict_ema": model_ema.module.state_dict(), "optimizer": optimizer.state_dict(),
                loss_scaler.state_dict_key: loss_scaler.state_dict()}, checkpoint)
    shutil.copyfile(checkpoint, os.path.join(args.out, "model_best.pth.tar"))
    torch.save(model, os.path.join(args.out, "model.pth"))  # the whole module, pickled

    x = next(iter(loader_eval))[0].contiguous(memory_format=torch.channels_last)
    model.eval()
    with torch.no_grad():
        ref = model(x)
        reloaded = torch.load(os.path.join(args.out, "model.pth"), weights_only=False).eval()
        state = torch.load(checkpoint, weights_only=True)["state_dict"]
        clones = [reloaded, pickle.loads(pickle.dumps(model)), copy.deepcopy(model)]
        same = [torch.equal(m(x), ref) for m in clones]
    print(f"reload/pickle/deepcopy forward equal: {same} state_dict keys: {len(state)}")
    truth["files"] = sorted(os.listdir(args.out))
    print("GROUND_TRUTH " + json.dumps(truth, sort_keys=True))


if __name__ == "__main__":
    main()
