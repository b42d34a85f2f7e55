"""nanoGPT train.py shape: a tiny GPT, get_batch() from a token tensor (no DataLoader), gradient
accumulation with loss / accum, GradScaler(enabled=False) as nanoGPT has on CPU, clip_grad_norm_,
estimate_loss() under no_grad every eval_interval iterations (from iter 0, before any training),
a hand-written cosine lr schedule, optional torch.compile. Like nanoGPT the loop runs iterations
0..max_iters inclusive, --steps being max_iters: GROUND_TRUTH "steps" counts optimizer updates."""

import argparse
import json
import math
import os
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn import functional as F

block_size, vocab_size, n_layer, n_head, n_embd = 32, 64, 2, 2, 32


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(n_embd), CausalSelfAttention(), nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
                                              h=nn.ModuleList([Block() for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) if targets is not None else None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8, help="max_iters")
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-interval", type=int, default=4)
    p.add_argument("--eval-iters", type=int, default=40)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--out", default="corpus-out")
    args = p.parse_args()
    max_iters, gradient_accumulation_steps, eval_interval, eval_iters = args.steps, args.grad_accum, args.eval_interval, args.eval_iters
    learning_rate, min_lr, warmup_iters, lr_decay_iters, grad_clip = 1e-3, 1e-4, 2, args.steps, 1.0
    always_save_checkpoint = True
    torch.set_num_threads(1)
    torch.manual_seed(1337)
    os.makedirs(args.out, exist_ok=True)
    data = torch.randint(0, vocab_size, (20000,))  # nanoGPT: np.memmap('train.bin'), here random tokens
    train_data, val_data = data[:18000], data[18000:]

    def get_batch(split):
        d = train_data if split == "train" else val_data
        ix = torch.randint(len(d) - block_size, (args.batch_size,))
        x = torch.stack([d[i:i + block_size] for i in ix])
        y = torch.stack([d[i + 1:i + 1 + block_size] for i in ix])
        return x, y

    ctx = nullcontext()  # device_type == 'cpu'
    model = GPT()
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # enabled only for float16
    optimizer = model.configure_optimizers(0.1, learning_rate, (0.9, 0.95))
    raw_model = model
    if args.compile:
        model = torch.compile(model)
    truth = {"steps": 0, "micro_steps": 0, "evals": 0, "eval_batches": 0}

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        truth["evals"], truth["eval_batches"] = truth["evals"] + 1, truth["eval_batches"] + 2 * eval_iters
        return out

    def get_lr(it):
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)

    X, Y = get_batch("train")
    iter_num, best_val_loss = 0, 1e9
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % eval_interval == 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses["val"] < best_val_loss or always_save_checkpoint:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num,
                                "best_val_loss": best_val_loss}, os.path.join(args.out, "ckpt.pt"))
        for micro_step in range(gradient_accumulation_steps):  # noqa: B007 - DDP uses it to sync on the last
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps  # scale the loss to account for gradient accumulation
            X, Y = get_batch("train")  # async prefetch of the next batch while the model does forward
            scaler.scale(loss).backward()
            truth["micro_steps"] += 1
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        truth["steps"] += 1
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}")  # nanoGPT adds time and mfu
        iter_num += 1
        if iter_num > max_iters:
            break
    truth["optimizer_steps"] = truth["steps"]
    truth["files"] = sorted(os.listdir(args.out))
    print("GROUND_TRUTH " + json.dumps(truth, sort_keys=True))


if __name__ == "__main__":
    main()
