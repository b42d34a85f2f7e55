"""Input-bound through a prefetching thread: prefetch_generator's BackgroundGenerator (which many repos vendor)
iterates a DataLoader whose samples cost 2 ms of (fake) decoding each (64 ms a batch: far more than the step's
compute even where a busy host slows that tenfold); the training thread waits on its queue, which its steps show as
"other"."""

import queue
import threading

import torch
from _common import SlowDataset, args, mlp
from torch.utils.data import DataLoader


class BackgroundGenerator(threading.Thread):
    def __init__(self, generator, max_prefetch=1):
        super().__init__(daemon=True)
        self.queue = queue.Queue(max_prefetch)
        self.generator = generator
        self.stopped = False
        self.start()

    def run(self):
        for item in self.generator:
            if self.stopped:
                return
            self.queue.put(item)
        self.queue.put(None)

    def close(self):
        """Stop fetching and wait for the thread: a daemon thread still inside torch as the interpreter ends can
        abort the process ("terminate called without an active exception")."""
        self.stopped = True
        while self.is_alive():
            try:
                self.queue.get(timeout=0.05)
            except queue.Empty:
                pass

    def __iter__(self):
        return self

    def __next__(self):
        item = self.queue.get()
        if item is None:
            raise StopIteration
        return item


a = args(60)
model = mlp()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
step = 0
while step < a.steps:
    batches = BackgroundGenerator(DataLoader(SlowDataset(0.002), batch_size=32, num_workers=0))
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step >= a.steps:
            break
    batches.close()
print("done", step)
