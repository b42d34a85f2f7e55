"""pytorch/examples imagenet/main.py shape: a full validation pass BEFORE training (a baseline, as
"validate before train" options do), then per epoch train() and validate() with model.train()/model.eval(),
save_checkpoint() writing checkpoint.pth.tar and copying model_best.pth.tar."""

import argparse
import json
import os
import shutil

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def train(train_loader, model, criterion, optimizer, epoch, truth):
    model.train()  # switch to train mode
    for images, target in train_loader:
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        truth["steps"] += 1
    print(f"Epoch: [{epoch}] loss {loss.item():.4f}")


def validate(val_loader, model, criterion, truth):
    model.eval()  # switch to evaluate mode
    loss_sum, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for images, target in val_loader:
            output = model(images)
            loss_sum += criterion(output, target).item() * images.size(0)
            correct += (output.argmax(1) == target).sum().item()
            n += images.size(0)
            truth["eval_batches"] += 1
    truth["evals"] += 1
    acc1 = 100.0 * correct / n
    print(f" * Acc@1 {acc1:.3f} loss {loss_sum / n:.4f}")
    return acc1


def save_checkpoint(state, is_best, out, filename="checkpoint.pth.tar"):
    torch.save(state, os.path.join(out, filename))
    if is_best:
        shutil.copyfile(os.path.join(out, filename), os.path.join(out, "model_best.pth.tar"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20, help="training batches in all")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--val-batches", type=int, default=80)
    parser.add_argument("-b", "--batch-size", type=int, default=16)
    parser.add_argument("--out", default="corpus-out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    w = torch.randn(64, 10)

    def dataset(n):
        x = torch.randn(n, 64)
        return TensorDataset(x, (x @ w).argmax(1))

    train_loader = DataLoader(dataset(args.batch_size * (args.steps // args.epochs)), batch_size=args.batch_size,
                              shuffle=True)
    val_loader = DataLoader(dataset(args.batch_size * args.val_batches), batch_size=args.batch_size, shuffle=False)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    truth = {"steps": 0, "evals": 0, "eval_batches": 0}
    best_acc1 = validate(val_loader, model, criterion, truth)
    for epoch in range(args.epochs):
        train(train_loader, model, criterion, optimizer, epoch, truth)
        acc1 = validate(val_loader, model, criterion, truth)
        scheduler.step()
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        save_checkpoint({"epoch": epoch + 1, "state_dict": model.state_dict(), "best_acc1": best_acc1,
                         "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, is_best, args.out)
    truth["files"] = sorted(os.listdir(args.out))
    print("GROUND_TRUTH " + json.dumps(truth, sort_keys=True))


if __name__ == "__main__":
    main()
