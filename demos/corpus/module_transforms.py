"""A Dataset whose __getitem__ applies nn.Module transforms (torchvision's scriptable style:
transforms = torch.nn.Sequential(RandomHorizontalFlip(), Normalize(mean, std))), read by a
DataLoader with num_workers=0 (so the transform modules run in the training process), then a
plain model + optimizer loop."""

import argparse
import json

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Normalize(nn.Module):  # torchvision.transforms.Normalize is an nn.Module too
    def __init__(self, mean, std):
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, tensor):
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        return (tensor - mean) / std


class RandomHorizontalFlip(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.p = p

    def forward(self, img):
        return img.flip(-1) if torch.rand(1) < self.p else img


class SyntheticImages(Dataset):
    def __init__(self, n, transform=None):
        g = torch.Generator().manual_seed(0)
        self.images = torch.rand(n, 3, 12, 12, generator=g)
        self.labels = torch.randint(0, 5, (n,), generator=g)
        self.transform = transform
        self.calls = 0

    def __len__(self):
        return len(self.images)

    def __getitem__(self, idx):
        img = self.images[idx]
        if self.transform is not None:
            img = self.transform(img)
            self.calls += 1
        return img, self.labels[idx]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    transforms = nn.Sequential(RandomHorizontalFlip(), Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)))
    dataset = SyntheticImages(args.batch_size * 4, transform=transforms)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    criterion = nn.CrossEntropyLoss()
    step = 0
    while step < args.steps:
        for images, labels in loader:
            loss = criterion(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % 4 == 0:
                print(f"step {step} loss {loss.item():.4f}")
            if step == args.steps:
                break
    truth = {"steps": step, "transform_calls": dataset.calls, "samples": step * args.batch_size}
    print("GROUND_TRUTH " + json.dumps(truth, sort_keys=True))


if __name__ == "__main__":
    main()
