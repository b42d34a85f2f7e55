"""pytorch/examples time_sequence_prediction/train.py shape: an LSTMCell sine-wave model trained with
torch.optim.LBFGS, optimizer.step(closure) where the closure runs zero_grad/forward/loss/backward
(many times a step); after every step a no_grad prediction of the test waves is saved."""
# ruff: noqa: UP031 - printf formatting as in the example

import argparse
import json
import math
import os

import torch
import torch.nn as nn
import torch.optim as optim


class Sequence(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.hidden = hidden
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = c_t = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        h_t2 = c_t2 = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for _ in range(future):  # if we should predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4, help="steps to run")
    parser.add_argument("--max-iter", type=int, default=8, help="LBFGS max_iter (closure calls per step)")
    parser.add_argument("--out", default="corpus-out")
    opt = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    os.makedirs(opt.out, exist_ok=True)
    # generate.py: sine waves with random phase shifts
    T, L, N = 20, 60, 24
    x = torch.arange(L).double().unsqueeze(0) + torch.randint(-4 * T, 4 * T, (N, 1)).double()
    data = torch.sin(x / T)
    input, target = data[3:, :-1], data[3:, 1:]
    test_input, test_target = data[:3, :-1], data[:3, 1:]
    seq = Sequence().double()
    criterion = nn.MSELoss()
    optimizer = optim.LBFGS(seq.parameters(), lr=0.8, max_iter=opt.max_iter)
    truth = {"steps": 0, "closure_calls": 0, "forward_calls": 0, "evals": 0}
    for i in range(opt.steps):
        print("STEP: ", i)

        def closure():
            optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            print("loss: %.6f" % loss.item())
            loss.backward()
            truth["closure_calls"] += 1
            truth["forward_calls"] += 1
            return loss

        optimizer.step(closure)
        truth["steps"] += 1
        # begin to predict, no need to track gradient here
        with torch.no_grad():
            future = 20
            pred = seq(test_input, future=future)
            loss = criterion(pred[:, :-future], test_target)
            print("test loss: %.6f" % loss.item())
            y = pred.detach()
        truth["forward_calls"] += 1
        truth["evals"] += 1
        torch.save(y, os.path.join(opt.out, "predict%d.pt" % i))  # the example draws predict%d.pdf
    assert not math.isnan(loss.item())
    truth["files"] = sorted(os.listdir(opt.out))
    print("GROUND_TRUTH " + json.dumps(truth, sort_keys=True))


if __name__ == "__main__":
    main()
