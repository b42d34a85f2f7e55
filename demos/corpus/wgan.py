"""The WGAN loop of the popular GAN collections (PyTorch-GAN's wgan.py shape): RMSprop for both networks, the
critic trained on every batch with its weights clipped, the generator every ``--n-critic`` batches. Which batch
the generator first trains on is ``--first-generator``: 0 (``i % n_critic == 0``) or n_critic - 1
(``(i + 1) % n_critic == 0``); both are written."""

import argparse
import json

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

LATENT = 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=15)
    parser.add_argument("--n-critic", type=int, default=5)
    parser.add_argument("--first-generator", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(LATENT, 64), nn.ReLU(), nn.Linear(64, 32), nn.Tanh())
    critic = nn.Sequential(nn.Linear(32, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    opt_g = torch.optim.RMSprop(generator.parameters(), lr=5e-5)
    opt_d = torch.optim.RMSprop(critic.parameters(), lr=5e-5)
    loader = DataLoader(TensorDataset(torch.randn(args.batches * 16, 32)), batch_size=16)
    truth = {"steps": 0, "generator_steps": 0, "samples": 0}
    for i, (real,) in enumerate(loader):
        opt_d.zero_grad()
        z = torch.randn(real.shape[0], LATENT)
        fake = generator(z).detach()
        loss_d = -torch.mean(critic(real)) + torch.mean(critic(fake))
        loss_d.backward()
        opt_d.step()
        for p in critic.parameters():
            p.data.clamp_(-0.01, 0.01)
        if i % args.n_critic == args.first_generator:
            opt_g.zero_grad()
            loss_g = -torch.mean(critic(generator(z)))
            loss_g.backward()
            opt_g.step()
            truth["generator_steps"] += 1
            print(f"[batch {i}] D loss {loss_d.item():.4f} G loss {loss_g.item():.4f}")
        truth["steps"] += 1
        truth["samples"] += real.shape[0]
    print("GROUND_TRUTH " + json.dumps(truth))


if __name__ == "__main__":
    main()
