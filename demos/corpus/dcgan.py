"""pytorch/examples dcgan/main.py shape at 32x32: netD/netG, two Adam optimizers; per batch a D step on
real + fake, then a G step. --no-loader: real batches come from torch.randn inside the loop."""
# ruff: noqa: UP031 - printf formatting as in the example

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

nc, nz, ngf, ndf = 3, 16, 8, 8


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, 1, 4, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="batches in all")
    parser.add_argument("--batchSize", type=int, default=16)
    parser.add_argument("--batches-per-epoch", type=int, default=4)
    parser.add_argument("--no-loader", action="store_true")
    parser.add_argument("--out", default="corpus-out", help="folder to output model checkpoints")
    opt = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(999)
    os.makedirs(opt.out, exist_ok=True)

    if opt.no_loader:
        dataloader = None
    else:
        images = torch.rand(opt.batchSize * opt.batches_per_epoch, nc, 32, 32) * 2 - 1
        dataloader = DataLoader(TensorDataset(images), batch_size=opt.batchSize, shuffle=True, drop_last=True)
    netG, netD = Generator(), Discriminator()
    netG.apply(weights_init)
    netD.apply(weights_init)
    criterion = nn.BCELoss()
    real_label, fake_label = 1.0, 0.0
    optimizerD = optim.Adam(netD.parameters(), lr=0.0002, betas=(0.5, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=0.0002, betas=(0.5, 0.999))
    truth = {"steps": 0, "optimizer_steps": {"D": 0, "G": 0}, "forward_calls": {"D": 0, "G": 0}}
    niter = -(-opt.steps // opt.batches_per_epoch)
    for epoch in range(niter):
        batches = dataloader if dataloader is not None else range(opt.batches_per_epoch)
        for i, data in enumerate(batches, 0):
            if truth["steps"] == opt.steps:
                break
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            real_cpu = data[0] if dataloader is not None else torch.randn(opt.batchSize, nc, 32, 32).tanh()
            batch_size = real_cpu.size(0)
            label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
            output = netD(real_cpu)
            errD_real = criterion(output, label)
            errD_real.backward()
            D_x = output.mean().item()
            noise = torch.randn(batch_size, nz, 1, 1)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            errD_fake.backward()
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            optimizerD.step()
            # (2) Update G network: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            output = netD(fake)
            errG = criterion(output, label)
            errG.backward()
            D_G_z2 = output.mean().item()
            optimizerG.step()
            truth["steps"] += 1
            truth["optimizer_steps"]["D"] += 1
            truth["optimizer_steps"]["G"] += 1
            truth["forward_calls"]["D"] += 3
            truth["forward_calls"]["G"] += 1
            print("[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f"
                  % (epoch, niter, i, opt.batches_per_epoch, errD.item(), errG.item(), D_x, D_G_z1, D_G_z2))
        # do checkpointing
        torch.save(netG.state_dict(), "%s/netG_epoch_%d.pth" % (opt.out, epoch))
        torch.save(netD.state_dict(), "%s/netD_epoch_%d.pth" % (opt.out, epoch))
    truth["files"] = sorted(os.listdir(opt.out))
    print("GROUND_TRUTH " + json.dumps(truth, sort_keys=True))


if __name__ == "__main__":
    main()
