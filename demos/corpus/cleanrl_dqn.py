"""DQN as CleanRL's dqn.py writes it, on a synthetic environment (no gym): epsilon-greedy acting with the Q
network (called with grad, as CleanRL does), a replay buffer, one update every --train-frequency env steps after
--learning-starts, and a soft target-network update every --target-network-frequency env steps. GROUND_TRUTH
"steps" counts the updates; the env steps between two updates belong to the later one."""

import argparse
import json
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class QNetwork(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int) -> None:
        super().__init__()
        self.network = nn.Sequential(nn.Linear(obs_dim, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                                     nn.Linear(84, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


def linear_schedule(start_e: float, end_e: float, duration: int, t: int) -> float:
    return max(slope * t + start_e, end_e) if (slope := (end_e - start_e) / duration) else end_e


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--total-timesteps", type=int, default=1200)
    p.add_argument("--learning-starts", type=int, default=200)
    p.add_argument("--train-frequency", type=int, default=4)
    p.add_argument("--target-network-frequency", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=0.99)
    args = p.parse_args()

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    torch.set_num_threads(1)
    obs_dim, n_actions = 4, 2
    q_network = QNetwork(obs_dim, n_actions)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=2.5e-4)
    target_network = QNetwork(obs_dim, n_actions)
    target_network.load_state_dict(q_network.state_dict())

    capacity = 10_000
    buf_obs = np.zeros((capacity, obs_dim), np.float32)
    buf_next = np.zeros((capacity, obs_dim), np.float32)
    buf_act = np.zeros(capacity, np.int64)
    buf_rew = np.zeros(capacity, np.float32)
    buf_done = np.zeros(capacity, np.float32)
    size = 0

    truth = {"steps": 0, "env_steps": 0}
    rng = np.random.default_rng(1)
    obs = rng.standard_normal(obs_dim).astype(np.float32)
    for global_step in range(args.total_timesteps):
        epsilon = linear_schedule(1.0, 0.05, args.total_timesteps // 2, global_step)
        if random.random() < epsilon:
            action = random.randrange(n_actions)
        else:
            q_values = q_network(torch.Tensor(obs))
            action = int(torch.argmax(q_values).cpu().numpy())
        next_obs = rng.standard_normal(obs_dim).astype(np.float32)
        reward, done = float(action == (obs[0] > 0)), float(global_step % 100 == 99)
        i = size % capacity
        buf_obs[i], buf_next[i], buf_act[i], buf_rew[i], buf_done[i] = obs, next_obs, action, reward, done
        size += 1
        obs = next_obs
        truth["env_steps"] += 1

        if global_step > args.learning_starts:
            if global_step % args.train_frequency == 0:
                idx = np.random.randint(0, min(size, capacity), args.batch_size)
                with torch.no_grad():
                    target_max, _ = target_network(torch.from_numpy(buf_next[idx])).max(dim=1)
                    td_target = torch.from_numpy(buf_rew[idx]) + args.gamma * target_max * (
                        1 - torch.from_numpy(buf_done[idx]))
                old_val = q_network(torch.from_numpy(buf_obs[idx])).gather(
                    1, torch.from_numpy(buf_act[idx]).view(-1, 1)).squeeze()
                loss = F.mse_loss(td_target, old_val)
                if global_step % 100 == 0:
                    print(f"global_step={global_step} td_loss={loss.item():.4f} q={old_val.mean().item():.3f}")
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                truth["steps"] += 1

            if global_step % args.target_network_frequency == 0:
                for target_param, q_param in zip(target_network.parameters(), q_network.parameters(), strict=True):
                    target_param.data.copy_(args.tau * q_param.data + (1.0 - args.tau) * target_param.data)
    print("GROUND_TRUTH " + json.dumps(truth, sort_keys=True))


if __name__ == "__main__":
    main()
