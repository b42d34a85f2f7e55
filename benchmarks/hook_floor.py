"""What Python hooks can cost at best, against what perfmon's hooks cost, inside one real training loop.

    python benchmarks/hook_floor.py [--job mlp|tiny] [--blocks 30] [--block-steps 200]

One process runs the loop of ``agent_cpu.py``'s job in blocks of ``--block-steps`` steps, rotating three ways of
running it (ABC, then CBA, so drifts hit all three):

* ``none``: plain torch;
* ``floor``: the least a Python hook can do: the same four places wrapped or hooked (DataLoader ``__next__``, the
  model's ``__call__``, ``torch.autograd.backward``, the optimizer step pre/post hooks), each appending two
  ``(code, perf_counter(), phase, None)`` tuples to a deque and nothing else: no step boundaries, no batch
  size, no compile check;
* ``perfmon-py``: perfmon's own hooks (``hooks.Instrumentation``), all in Python, appending to a deque; no agent
  threads;
* ``perfmon-c``: the same with the C hot path (``perfmon/agent/_hot.c``: the fetch, backward and optimizer hooks
  in C; the model's ``__call__`` stays a Python wrapper), where it was built.

Printed: the training thread's CPU per step for each (median and minimum over the blocks), the difference from
``none``, and the median difference from the ``none`` block of the same rotation (the steadiest figure). What ``floor`` costs is what any design built on Python hooks pays on this loop; what ``perfmon`` costs
beyond it is perfmon's own logic. Both are larger in a real loop than in a micro-benchmark: torch's work between
the hooks leaves their code and data cache-cold.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=("mlp", "tiny"), default="mlp")
    p.add_argument("--blocks", type=int, default=30)
    p.add_argument("--block-steps", type=int, default=200)
    args = p.parse_args()

    import agent_cpu
    import torch
    from torch import nn
    from torch.optim import optimizer as optim_mod
    from torch.utils.data import dataloader

    from perfmon.agent.hooks import Instrumentation
    from perfmon.agent.native import event_buffer

    step = agent_cpu.make_step(args.job)
    events: deque = deque(maxlen=10_000)
    append = events.append
    orig_backward = torch.autograd.backward
    orig_next = dataloader._BaseDataLoaderIter.__next__
    model_cls = nn.Sequential if args.job == "mlp" else nn.Linear
    handles: list = []

    def floor_on() -> None:
        module_call = nn.Module.__call__

        def __call__(mod, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            append((0, perf_counter(), "forward", None))
            try:
                return module_call(mod, *a, **k)
            finally:
                append((1, perf_counter(), "forward", None))

        def backward(*a, **k):  # noqa: ANN002, ANN003, ANN202
            append((0, perf_counter(), "backward", None))
            try:
                return orig_backward(*a, **k)
            finally:
                append((1, perf_counter(), "backward", None))

        def fetch(it):  # noqa: ANN001, ANN202
            append((0, perf_counter(), "data", None))
            try:
                return orig_next(it)
            finally:
                append((1, perf_counter(), "data", None))

        model_cls.__call__ = __call__
        torch.autograd.backward = backward
        dataloader._BaseDataLoaderIter.__next__ = fetch
        handles.append(optim_mod.register_optimizer_step_pre_hook(
            lambda o, a, k: append((0, perf_counter(), "optimizer", None))))
        handles.append(optim_mod.register_optimizer_step_post_hook(
            lambda o, a, k: append((6, perf_counter(), "optimizer", None))))

    def floor_off() -> None:
        del model_cls.__call__
        torch.autograd.backward = orig_backward
        dataloader._BaseDataLoaderIter.__next__ = orig_next
        for h in handles:
            h.remove()
        handles.clear()

    buffers: list = [events]

    def perfmon_way(accelerated: bool) -> tuple:
        buffer = event_buffer(100_000)  # the agent's own: the C hooks write compact slots to it
        buffers.append(buffer)
        inst = Instrumentation(lambda code, arg: buffer.append((code, perf_counter(), arg, None)),
                               lambda where, exc: None, accelerated=accelerated)

        def on() -> None:
            inst.install()
            inst.fast = buffer.append
            for _ in range(3):  # the first step finds the model
                step()

        return on, inst.uninstall

    ways = {"none": (lambda: None, lambda: None), "floor": (floor_on, floor_off), "perfmon-py": perfmon_way(False)}
    if Instrumentation(append, lambda where, exc: None)._hot is not None:
        ways["perfmon-c"] = perfmon_way(True)  # the C hot path, where it was built
    results: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(200):
        step()
    order = list(ways)
    for i in range(args.blocks):
        for name in order if i % 2 == 0 else order[::-1]:
            on, off = ways[name]
            on()
            for _ in range(20):
                step()
            t0 = time.thread_time()
            for _ in range(args.block_steps):
                step()
            results[name].append((time.thread_time() - t0) / args.block_steps * 1e6)
            off()
            for buffer in buffers:  # what the agent's thread does every tick, outside the timed steps
                drain = getattr(buffer, "drain", None)
                drain() if drain is not None else buffer.clear()
    base = results["none"]
    print(f"job {args.job}: {args.blocks} blocks of {args.block_steps} steps each way, training thread CPU per step")
    for name, vals in results.items():
        med, low = statistics.median(vals), min(vals)
        # each block against the plain block next to it in the same rotation: drifts of the machine cancel
        paired = statistics.median(v - b for v, b in zip(vals, base, strict=True))
        print(f"  {name:10s} median {med:9.2f} us ({med - statistics.median(base):+6.2f})   min {low:9.2f} us "
              f"({low - min(base):+6.2f})   paired median {paired:+6.2f}")


if __name__ == "__main__":
    main()
