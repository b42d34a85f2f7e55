"""Knowledge distillation (Hinton et al.): a large frozen teacher runs under torch.no_grad() inside every
training step, a small student is trained on alpha * T^2 * KL(student/T || teacher/T) + (1 - alpha) * CE."""

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def mlp(sizes):
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def distillation_loss(student_logits, teacher_logits, labels, T=4.0, alpha=0.9):
    soft = F.kl_div(F.log_softmax(student_logits / T, dim=1), F.softmax(teacher_logits / T, dim=1),
                    reduction="batchmean") * (T * T)
    return alpha * soft + (1.0 - alpha) * F.cross_entropy(student_logits, labels)


def train_one_epoch(student, teacher, loader, optimizer, epoch, truth, max_steps):
    student.train()
    for batch_idx, (inputs, labels) in enumerate(loader):
        if truth["steps"] == max_steps:
            return
        with torch.no_grad():
            teacher_logits = teacher(inputs)
        truth["teacher_forwards"] += 1
        student_logits = student(inputs)
        loss = distillation_loss(student_logits, teacher_logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        truth["steps"] += 1
        if batch_idx % 4 == 0:
            print(f"epoch {epoch} batch {batch_idx} loss {loss.item():.4f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--teacher-width", type=int, default=1024)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    x = torch.randn(args.batch_size * 8, 256)
    y = torch.randint(0, 10, (len(x),))
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, drop_last=True)
    w = args.teacher_width
    teacher = mlp([256, w, w, w, 10])  # stands in for a trained checkpoint: teacher.load_state_dict(...)
    teacher.requires_grad_(False)
    teacher.eval()
    student = mlp([256, 64, 10])
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
    truth = {"steps": 0, "teacher_forwards": 0}
    epoch = 0
    while truth["steps"] < args.steps:
        train_one_epoch(student, teacher, loader, optimizer, epoch, truth, args.steps)
        epoch += 1
    truth["optimizer_steps"] = truth["steps"]
    print("GROUND_TRUTH " + json.dumps(truth, sort_keys=True))


if __name__ == "__main__":
    main()
