"""The C hot path (perfmon/agent/_hot.c) against the pure-Python hooks: the same events on real loops.

Each loop shape runs once under the Python hooks and once under the C ones, in this process, with the
agent's fast path on (events appended straight to the buffer) and off (every event through ``emit``); the
event streams, the boundaries the commands see and the errors must be identical.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from perfmon.agent import hooks as hooks_mod
from perfmon.agent.hooks import Instrumentation
from perfmon.agent.native import event_buffer
from perfmon.agent.steps import NEW_EPOCH_BEGINS, STEADY, expand_steady

HOT = hooks_mod.accelerator()
needs_hot = pytest.mark.skipif(HOT is None, reason="the C hot path is not built here (no C compiler at install)")


def test_the_c_hot_path_is_built_where_a_compiler_exists():
    if HOT is None and shutil.which("cc") and Path(sysconfig.get_paths()["include"], "Python.h").exists() \
            and not os.environ.get("PERFMON_NO_ACCEL"):
        pytest.fail("a C compiler and Python.h are here, yet perfmon.agent._hot did not build: "
                    "reinstall with `pip install -e .` and read its build output")


def test_perfmon_no_accel_turns_it_off(monkeypatch):
    monkeypatch.setenv("PERFMON_NO_ACCEL", "1")
    assert hooks_mod.accelerator() is None
    assert Instrumentation(lambda c, a: None, lambda w, e: None)._hot is None


# -- loop shapes, written as scripts write them -----------------------------------------------------------

def _loader(n: int = 8, batch: Any = "tuple") -> DataLoader:
    x, y = torch.randn(n * 2, 4), torch.randn(n * 2, 1)
    if batch == "dict":
        class Dicts(Dataset):
            def __len__(self) -> int:
                return n * 2

            def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
                return {"x": x[i], "y": y[i]}

        return DataLoader(Dicts(), batch_size=2)
    return DataLoader(TensorDataset(x, y), batch_size=2)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def plain() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        for xb, yb in _loader():
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()


def dict_batches_and_eval() -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for i, batch in enumerate(_loader(batch="dict")):
        loss = model(batch["x"]).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i % 3 == 2:
            with torch.no_grad():
                for xb in _loader(3, batch="dict"):
                    model(xb["x"])


def gan() -> None:
    g, d = _mlp(), nn.Sequential(nn.Linear(1, 4), nn.ReLU(), nn.Linear(4, 1))
    opt_g, opt_d = torch.optim.Adam(g.parameters()), torch.optim.Adam(d.parameters())
    for xb, _ in _loader():
        fake = g(xb)
        loss_d = d(fake.detach()).mean() - d(torch.randn(2, 1)).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        loss_g = -d(fake).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()


def accumulation_and_checkpoint(tmp: Path) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (xb, yb) in enumerate(_loader(12)):
        (nn.functional.mse_loss(model(xb), yb) / 3).backward()
        if i % 3 == 2:
            opt.step()
            opt.zero_grad()
        if i == 5:
            torch.save(model.state_dict(), tmp / "ckpt.pt")


def lbfgs() -> None:
    model = _mlp()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=3)
    x, y = torch.randn(4, 4), torch.randn(4, 1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)


CLOSURE_WORK_S = 0.02  # the closure's own work in ``lightning_closure`` (a framework's hooks, logging)
CLOSURE_RESULTS: list[Any] = []  # what each optimizer.step(closure) returned


def lightning_closure() -> None:
    """PyTorch Lightning's automatic optimization: every step is ``optimizer.step(closure=...)``, the closure runs
    the training step, ``zero_grad`` and the backward, with the framework's own work around them."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    CLOSURE_RESULTS.clear()
    for i, (xb, yb) in enumerate(_loader()):
        def closure(xb: torch.Tensor = xb, yb: torch.Tensor = yb) -> torch.Tensor:
            loss = nn.functional.mse_loss(model(xb), yb)
            until = perf_counter() + CLOSURE_WORK_S
            while perf_counter() < until:  # the framework's hooks and logging
                pass
            opt.zero_grad()
            loss.backward()
            return loss

        CLOSURE_RESULTS.append(opt.step(closure=closure) if i % 2 else opt.step(closure))  # both ways of passing it


def activation_checkpointing() -> None:
    """torch.utils.checkpoint (HF's gradient_checkpointing): the blocks' forwards run again inside the backward."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4)) for _ in range(2))
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return self.head(x)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for xb, yb in _loader():
        loss = nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()


def manual_updates_and_a_failing_backward() -> None:
    model = _mlp()
    for xb, yb in _loader():
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        try:
            loss.backward()  # the graph is freed: the script catches it, as some do
        except RuntimeError:
            pass
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None


def odd_batches() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(4), [torch.randn(3, 4)], {"a": [torch.randn(5, 4)]}, "text", [], torch.tensor(1.0)]

    class Odd(Dataset):
        def __len__(self) -> int:
            return len(batches)

        def __getitem__(self, i: int) -> Any:
            return batches[i]

    for _ in DataLoader(Odd(), batch_size=None):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()


def distillation_and_ema() -> None:
    import copy

    teacher, student = _mlp().eval(), _mlp()
    ema = copy.deepcopy(student)
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    for xb, _ in _loader():
        with torch.no_grad():
            target = teacher(xb)
        loss = nn.functional.mse_loss(student(xb), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), student.parameters(), strict=True):
                e.mul_(0.9).add_(p, alpha=0.1)
            ema(xb)  # an evaluation of the copy


SHAPES: dict[str, Callable[..., None]] = {
    "distillation_and_ema": distillation_and_ema,
    "plain": plain, "dict_batches_and_eval": dict_batches_and_eval, "gan": gan,
    "accumulation_and_checkpoint": accumulation_and_checkpoint, "lbfgs": lbfgs, "lightning_closure": lightning_closure,
    "activation_checkpointing": activation_checkpointing,
    "manual_updates_and_a_failing_backward": manual_updates_and_a_failing_backward, "odd_batches": odd_batches,
}


def _normalised(events: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """Module and optimizer ids replaced by the order they were first seen in (each run builds new ones)."""
    ids: dict[int, int] = {}

    def norm(arg: Any) -> Any:
        if isinstance(arg, tuple) and len(arg) >= 2 and arg[0] in ("forward", "optimizer") and isinstance(arg[1], int):
            return (arg[0], ids.setdefault(arg[1], len(ids)), *arg[2:])
        return arg

    return [(code, norm(arg)) for code, arg in events]


def run_shape(shape: str, accelerated: bool, fast: bool | str, tmp: Path) -> dict[str, Any]:
    """``fast``: True for the fast path to a Python sink, False for every event through ``emit``, "ring" for the
    agent's own buffer (``native.event_buffer``: the C hooks write compact slots there that ``drain`` expands)."""
    events: list[tuple[int, Any]] = []
    times: list[float] = []
    errors: list[tuple[str, BaseException]] = []
    boundaries: list[int] = []
    ring = event_buffer(1_000_000) if fast == "ring" else None

    def emit(code: int, arg: Any = None) -> None:
        if ring is not None:  # what Agent.emit does
            ring.append((code, perf_counter(), arg, None))
            return
        events.append((code, arg))
        times.append(perf_counter())

    def append(event: tuple[int, float, Any, Any]) -> None:
        code, t, arg, mark = event
        assert mark is None
        events.append((code, arg))
        times.append(t)

    inst = Instrumentation(emit, lambda where, exc: errors.append((where, exc)),
                           lambda: boundaries.append(len(events) if ring is None else len(ring)), accelerated=accelerated)
    assert (inst._hot is not None) == accelerated
    inst.install()
    if ring is not None:
        inst.fast = ring.append
        assert inst.bounds.ring is ring  # the C hooks write there directly
    elif fast:
        inst.fast = append
    torch.manual_seed(0)
    try:
        fn = SHAPES[shape]
        fn(tmp) if shape == "accumulation_and_checkpoint" else fn()
    finally:
        inst.uninstall()
    folded = 0
    if ring is not None:
        for event in ring.drain():
            if event[0] == STEADY:  # a steady iteration the C ring folded: the events it stands for
                folded += 1
                for sub in expand_steady(event):
                    append(sub)
            else:
                append(event)
    assert times == sorted(times), "event times go backwards"
    return {"events": _normalised(events), "boundaries": boundaries, "errors": errors,
            "optimizers": len(inst.optimizers), "folded": folded}


@needs_hot
@pytest.mark.parametrize("fast", [True, False, "ring"], ids=["fast", "emit", "ring"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_c_hooks_record_exactly_what_python_hooks_record(shape, fast, tmp_path):
    python = run_shape(shape, accelerated=False, fast=fast, tmp=tmp_path)
    c = run_shape(shape, accelerated=True, fast=fast, tmp=tmp_path)
    assert python["errors"] == [] and c["errors"] == []
    assert python["folded"] == 0  # only the C hooks' compact slots are folded
    if fast == "ring" and shape in ("plain", "dict_batches_and_eval"):
        assert c["folded"] > 0  # steady iterations came out as one STEADY event each
    c["folded"] = 0
    assert c == python
    assert len(python["events"]) > 10  # the loop was really seen


@pytest.mark.parametrize("accelerated", [False, pytest.param(True, marks=needs_hot)], ids=["python", "c"])
def test_hooks_end_their_phase_and_reraise_when_the_call_fails(accelerated):
    events: list[tuple[int, Any]] = []
    inst = Instrumentation(lambda code, arg=None: events.append((code, arg)), lambda *a: None, accelerated=accelerated)
    inst.install()
    inst.fast = lambda ev: events.append((ev[0], ev[2]))
    try:
        assert (type(torch.autograd.backward).__name__ == "Timed") == accelerated
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.tensor(1.0).backward()
        assert [code for code, _ in events] == [0, 1]

        class Broken(Dataset):
            def __len__(self) -> int:
                return 2

            def __getitem__(self, i: int) -> Any:
                raise KeyError(f"bad sample {i}")

        events.clear()
        with pytest.raises(KeyError, match="bad sample 0"):
            next(iter(DataLoader(Broken())))
        # (the failed backward ended a step: no optimizer exists, so a BOUNDARY comes first)
        assert events[-2:] == [(0, "data"), (1, ("data", False))] and inst.bounds.in_data == 0 and inst.bounds.depth == 0
    finally:
        inst.uninstall()


@pytest.mark.parametrize("accelerated", [False, pytest.param(True, marks=needs_hot)], ids=["python", "c"])
def test_an_epoch_is_timed_from_its_iterator_to_the_fetch_that_finds_the_loader_done(accelerated):
    """``iter(loader)`` is data (it starts the workers of a loader without persistent ones: seconds under spawn,
    every epoch) that says a loader's epoch begins (no batch: the tracker must not count it as another loop's
    fetch), and the fetch that raises StopIteration ends as ("data", False), not as a fetch of no tensor."""
    events: list[tuple[int, Any]] = []
    inst = Instrumentation(lambda code, arg=None: events.append((code, arg)), lambda *a: None, accelerated=accelerated)
    inst.install()
    inst.fast = lambda ev: events.append((ev[0], ev[2]))
    try:
        loader = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2)
        for _ in range(2):
            for _batch in loader:
                pass
        epoch = [(0, NEW_EPOCH_BEGINS), (1, ("data", None)), (0, "data"), (1, ("data", 2)), (0, "data"), (1, ("data", 2)),
                 (0, "data"), (1, ("data", False))]
        assert events == epoch + epoch
        assert inst.loaders and inst.bounds.in_data == 0 and inst.bounds.depth == 0
    finally:
        inst.uninstall()


@pytest.mark.parametrize("accelerated", [False, pytest.param(True, marks=needs_hot)], ids=["python", "c"])
def test_hooks_never_raise_their_own_errors_into_training(accelerated):
    errors: list[tuple[str, BaseException]] = []
    inst = Instrumentation(lambda *a: None, lambda where, exc: errors.append((where, exc)), accelerated=accelerated)
    inst.install()

    def broken_buffer(event: Any) -> None:
        raise MemoryError("buffer")

    inst.fast = broken_buffer
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for xb, yb in _loader(2):
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
    finally:
        inst.uninstall()
    assert errors and all(where == "hooks" and isinstance(exc, MemoryError) for where, exc in errors)


@needs_hot
def test_patched_functions_keep_their_name_signature_and_docs():
    import inspect

    before = inspect.signature(torch.autograd.backward), torch.autograd.backward.__doc__
    inst = Instrumentation(lambda *a: None, lambda *a: None)
    inst.install()
    try:
        wrapped = torch.autograd.backward
        assert type(wrapped).__name__ == "Timed"
        assert (inspect.signature(wrapped), wrapped.__doc__) == before
        assert wrapped.__name__ == "backward" and wrapped.__wrapped__ is wrapped.__perfmon_original__
    finally:
        inst.uninstall()
    assert type(torch.autograd.backward).__name__ == "function"


@needs_hot
def test_a_compiled_optimizer_step_and_training_step_run_as_without_perfmon():
    """torch.compile over code that calls the C hooks (backward, the optimizer's): same numbers, no error."""
    script = r"""
import sys, torch
from torch import nn
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters(), lr=0.1)
x, y = torch.randn(8, 4), torch.randn(8, 1)
@torch.compile(backend="eager")
def opt_step():
    opt.step()
@torch.compile(backend="eager")
def train_step():
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss
for _ in range(3):
    loss = train_step()
    opt_step()
    opt.zero_grad()
print(round(loss.item(), 6), [round(v, 6) for v in model.weight.flatten().tolist()])
"""
    plain = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    hooked = subprocess.run([sys.executable, "-c", "import sys\nfrom perfmon.agent.hooks import Instrumentation\n"
                             "events = []\ninst = Instrumentation(lambda c, a=None: events.append(c), "
                             "lambda w, e: print('ERROR', w, e, file=sys.stderr))\ninst.install()\n"
                             "inst.fast = events.append\n" + script + "\nassert len(events) > 6, events\n"
                             + _NOTHING_OF_PERFMON_COMPILED],
                            capture_output=True, text=True, timeout=240)
    assert plain.returncode == 0, plain.stderr
    assert hooked.returncode == 0, hooked.stderr
    assert "ERROR" not in hooked.stderr
    assert hooked.stdout == plain.stdout + "compiled of perfmon: []\n"


#: Printed at the end of a script: perfmon's code objects dynamo compiled (a C hook called from compiled code runs
#: perfmon's Python with dynamo's frame callback set; the discovery that ends at the compiled optimizer step was
#: compiled frame by frame, graph breaks and all).
_NOTHING_OF_PERFMON_COMPILED = r"""
import gc, os, types, perfmon
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
root = os.path.dirname(perfmon.__file__)
codes = {f.__code__ for f in gc.get_objects() if type(f) is types.FunctionType
         and f.__code__.co_filename.startswith(root)}
print("compiled of perfmon:", sorted(c.co_name for c in codes if _debug_get_cache_entry_list(c)))
"""


@pytest.mark.parametrize("accelerated", [False, pytest.param(True, marks=needs_hot)], ids=["python", "c"])
def test_the_commands_see_every_boundary_and_work_when_something_is_due(accelerated, tmp_path):
    """The C hook counts boundaries itself and calls the commands only when something is set; the work done, and
    the boundaries it is done at, are the Python hooks' own."""
    from types import SimpleNamespace

    from perfmon.agent.commands import Commands

    agent = SimpleNamespace(run_dir=tmp_path, enabled=True, record_error=lambda where, exc: pytest.fail(f"{where}: {exc}"),
                            publish=lambda msg: None, tracker=SimpleNamespace(count=0))
    cmds = Commands(agent, {})
    worked: list[int] = []
    calls: list[int] = []
    after_count = cmds.after_count
    cmds._boundary_work = lambda: worked.append(cmds.boundaries)  # type: ignore[method-assign]
    cmds.after_count = lambda: (calls.append(cmds.boundaries), after_count())  # type: ignore[method-assign]
    inst = Instrumentation(lambda *a: None, lambda where, exc: pytest.fail(f"{where}: {exc}"), cmds.boundary,
                           accelerated=accelerated, commands=cmds)
    inst.install()
    inst.fast = lambda event: None
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def steps(n: int) -> None:
            for _ in range(n):
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()

        steps(5)
        assert cmds.boundaries >= 4 and worked == []
        idle_calls, first = len(calls), cmds.boundaries
        cmds._next_every = cmds.boundaries + 2  # a periodic window due two boundaries from now
        steps(3)
        cmds._next_every = None
        cmds.pending = True  # a command arrived
        steps(1)
    finally:
        inst.uninstall()
    assert worked[0] == worked[1] - 1 and worked[-1] == cmds.boundaries  # due from the 2nd boundary on, then pending
    if accelerated:  # nothing set: no Python call at a steady step's end (the first steps teach the loop)
        assert idle_calls <= 2
    else:
        assert idle_calls == first


@needs_hot
def test_c_hooks_leak_nothing_per_step():
    """A reference the C code forgot to drop would leave at least one object per step behind."""
    import gc

    sink: list[Any] = []
    inst = Instrumentation(lambda *a: None, lambda where, exc: pytest.fail(f"{where}: {exc}"))
    inst.install()
    inst.fast = sink.append
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = _loader(1000)  # 1,000 batches of 2

        def epoch() -> None:
            for xb, yb in loader:
                loss = nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
            sink.clear()
            gc.collect()

        epoch()
        growth = []
        # A forgotten reference leaves >= 1,000 blocks behind every epoch. A thread another test left running can
        # allocate a few hundred during one (the suite on a loaded machine): the epoch is measured up to three
        # times, and a leak fails all three.
        for _ in range(3):
            before = sys.getallocatedblocks()
            epoch()
            growth.append(sys.getallocatedblocks() - before)
            if growth[-1] < 300:
                break
    finally:
        inst.uninstall()
    assert min(growth) < 300, f"blocks more after each epoch of 1,000 steps: {growth}"


@pytest.mark.parametrize("maxlen, appends", [(1, 3), (4, 4), (4, 11), (3000, 5000), (5000, 2500)])
def test_the_event_buffer_keeps_the_newest_in_order_and_counts_what_it_dropped(maxlen, appends):
    """The C ring against a deque of the same maxlen (the Python buffer): same events out, oldest first, after
    growing, wrapping and dropping; drained twice across a wrap."""
    from collections import deque

    from perfmon.agent.native import HOT, EventDeque

    ways = [EventDeque(maxlen=maxlen)] + ([HOT.Ring(maxlen)] if HOT is not None else [])
    for buffer in ways:
        reference: deque = deque(maxlen=maxlen)
        half = appends // 2
        for i in range(half):
            event = (i % 7, float(i), ("data", i), None)
            buffer.append(event)
            reference.append(event)
        assert len(buffer) == len(reference)
        assert buffer.drain() == list(reference)
        reference.clear()
        for i in range(half, appends):
            event = (i % 7, float(i), "forward", None)
            buffer.append(event)
            reference.append(event)
        assert buffer.drain() == list(reference) and len(buffer) == 0 and buffer.drain() == []
        if isinstance(buffer, EventDeque):
            continue
        assert buffer.maxlen == maxlen
        assert buffer.dropped == max(0, half - maxlen) + max(0, appends - half - maxlen)


@needs_hot
def test_the_c_clock_is_perf_counter():
    before = perf_counter()
    t = HOT.clock()
    after = perf_counter()
    assert before <= t <= after


@needs_hot
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_tracker_makes_the_same_steps_of_folded_and_expanded_events(shape, tmp_path):
    """STEADY events (steady iterations the C ring folded) give the tracker exactly the steps their expansion
    gives, fed whole or in random chunks (so they also meet the general path, not only the fast one)."""
    import random

    from perfmon.agent.steps import StepTracker

    ring = event_buffer(1_000_000)
    inst = Instrumentation(lambda code, arg=None: ring.append((code, perf_counter(), arg, None)),
                           lambda where, exc: pytest.fail(f"{where}: {exc}"))
    inst.install()
    inst.fast = ring.append
    torch.manual_seed(0)
    try:
        fn = SHAPES[shape]
        fn(tmp_path) if shape == "accumulation_and_checkpoint" else fn()
    finally:
        inst.uninstall()
    folded = ring.drain()
    expanded = [sub for ev in folded for sub in (expand_steady(ev) if ev[0] == STEADY else [ev])]

    def steps(events: list, seed: int | None) -> list:
        tracker, out, i = StepTracker(), [], 0
        rng = random.Random(seed)
        while i < len(events):
            k = len(events) if seed is None else rng.randint(1, 7)
            out += tracker.feed_many(events[i : i + k])
            i += k
        last = tracker.finish()
        return out + ([last] if last is not None else [])

    reference = steps(expanded, None)
    assert reference
    for seed in (None, 1, 2, 3):
        assert steps(folded, seed) == reference


@pytest.mark.parametrize("accelerated", [False, pytest.param(True, marks=needs_hot)], ids=["python", "c"])
def test_a_step_without_a_closure_is_left_as_it_came(accelerated, monkeypatch):
    """accelerate's and Lightning's wrappers call ``step(None)`` / ``step(closure=None)`` every step: no wrapper
    is made, nothing is called beyond the hooks' common case."""
    inst = Instrumentation(lambda code, arg=None: None, lambda where, exc: pytest.fail(f"{where}: {exc}"),
                           accelerated=accelerated)
    asked: list[Any] = []
    monkeypatch.setattr(inst, "wrap_closure", lambda *a: asked.append(a))
    inst.install()
    try:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for call in (lambda: opt.step(None), lambda: opt.step(closure=None), lambda: opt.step()):
            model(torch.randn(2, 4)).sum().backward()
            assert call() is None
        assert asked == []
        opt.step(lambda: None)
        assert len(asked) == 1  # a closure is handed over
    finally:
        inst.uninstall()


@pytest.mark.parametrize("accelerated", [False, pytest.param(True, marks=needs_hot)], ids=["python", "c"])
def test_checkpointed_blocks_recomputed_in_the_backward_are_backward_time(accelerated, tmp_path):
    """Activation checkpointing runs the blocks' forwards again inside the backward (on the calling thread on a
    CPU): that is the backward's cost, and a block is not a root of its own."""
    res = run_shape("activation_checkpointing", accelerated=accelerated, fast=True, tmp=tmp_path)
    assert res["errors"] == []
    inside, forwards_in_backward, roots = 0, 0, set()
    for code, arg in res["events"]:
        phase = arg[0] if isinstance(arg, tuple) else arg
        if phase == "backward":
            inside += 1 if code == 0 else -1
        elif phase == "forward" and code == 0:
            forwards_in_backward += inside > 0
            roots.add(arg[1])
    assert forwards_in_backward == 0
    assert roots == {0}  # the model only (ids numbered in the order seen)
    assert sum(1 for code, arg in res["events"] if code == 0 and isinstance(arg, tuple) and arg[0] == "forward") == 8


@pytest.mark.parametrize("accelerated", [False, pytest.param(True, marks=needs_hot)], ids=["python", "c"])
def test_a_closures_own_work_is_other_not_the_optimizers(accelerated):
    """``optimizer.step(closure)`` the way Lightning calls it: the closure's own work (here a spin standing for the
    framework's hooks) is charged to "other", its forward and backward to forward and backward, and the step
    returns what the closure returned."""
    from perfmon.agent.steps import StepTracker

    ring = event_buffer(100_000)
    inst = Instrumentation(lambda code, arg=None: ring.append((code, perf_counter(), arg, None)),
                           lambda where, exc: pytest.fail(f"{where}: {exc}"), accelerated=accelerated)
    inst.install()
    inst.fast = ring.append
    try:
        lightning_closure()
    finally:
        inst.uninstall()
    assert all(isinstance(r, torch.Tensor) and r.requires_grad for r in CLOSURE_RESULTS)  # the closure's loss
    tracker = StepTracker()
    steps = [s for s in tracker.feed_many(ring.drain()) if s is not None]
    last = tracker.finish()
    steps += [last] if last is not None else []
    assert len(steps) == len(CLOSURE_RESULTS) == 8
    for step in steps:
        assert step.closures == 1
        assert step.other >= CLOSURE_WORK_S  # without the closure's own phase, the spin was the optimizer's
        assert step.phases["forward"] > 0 and step.phases["backward"] > 0


@pytest.mark.parametrize("accelerated", [False, pytest.param(True, marks=needs_hot)], ids=["python", "c"])
def test_torch_threads_are_read_on_the_training_thread_at_a_step_end(accelerated, tmp_path):
    """torch keeps the thread count per thread once a thread has asked for it (OpenMP's own setting, set at its first
    call): the sampler's thread, which asked before the script's set_num_threads, would keep reading the old count. The count the sampler sends is read by the training thread at a step end."""
    import threading
    from types import SimpleNamespace

    from perfmon.agent.commands import Commands

    agent = SimpleNamespace(run_dir=tmp_path, enabled=True, record_error=lambda where, exc: pytest.fail(f"{where}: {exc}"),
                            publish=lambda msg: None, tracker=SimpleNamespace(count=0))
    before = torch.get_num_threads()
    seen: list[int] = []
    ready, asked = threading.Event(), threading.Event()

    def sampler() -> None:  # reads once before the script changes its thread count, then again after
        seen.append(torch.get_num_threads())
        ready.set()
        asked.wait(30)
        seen.append(torch.get_num_threads())

    other = threading.Thread(target=sampler)
    other.start()
    ready.wait(30)
    cmds = Commands(agent, {})
    inst = Instrumentation(lambda *a: None, lambda where, exc: pytest.fail(f"{where}: {exc}"), cmds.boundary,
                           accelerated=accelerated, commands=cmds)
    inst.install()
    inst.fast = lambda event: None
    want = before + 2
    try:
        cmds.read_torch_threads()
        assert cmds.torch_threads == before
        torch.set_num_threads(want)
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
        assert cmds.torch_threads == before  # nobody asked
        cmds.refresh_torch_threads()
        cmds.refresh_torch_threads()  # asked twice: read once
        assert sum(q[0] == "read_threads" for q in cmds._queue) == 1
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        assert cmds.torch_threads == want and not cmds.pending
        asked.set()
        other.join()
        assert seen == [before, before]  # what a thread of its own would have sent
    finally:
        asked.set()
        other.join()
        inst.uninstall()
        torch.set_num_threads(before)


@needs_hot
def test_steady_steps_made_in_c_read_and_compare_as_step_records(monkeypatch):
    """The tracker's fast path makes the steps of a steady loop in C (``_hot.SteadyStep``): each equals the
    StepRecord the Python path makes of the same events, and reads like one (phases, samples, duration, other,
    marks, closures)."""
    from perfmon.agent import steps as steps_mod
    from perfmon.agent.steps import NO_MARKS, OPTIMIZER_CREATED, STEADY, StepRecord, StepTracker

    t = 100.0
    events = [(OPTIMIZER_CREATED, t, None, None)]
    for k in range(6):  # with and without a DataLoader fetch, samples 64 or none
        fetch = k % 2 == 0
        a = (t + 0.001 if fetch else None, t + 0.0015 if fetch else None, 64 if k % 3 == 0 else (0 if fetch else None),
             t + 0.002, "model", t + 0.004, t + 0.0045, t + 0.007, t + 0.0071, "opt")
        t += 0.008
        events.append((STEADY, t, a, None))

    def run() -> tuple[list, StepTracker]:
        tracker = StepTracker()
        out = tracker.feed_many(list(events))
        last = tracker.finish()
        return out + ([last] if last is not None else []), tracker

    fast, tracker = run()
    monkeypatch.setattr(steps_mod, "_steady_steps", None)
    slow, slow_tracker = run()
    assert len(fast) == len(slow) == 6
    assert {type(r).__name__ for r in fast[1:]} == {"SteadyStep"}  # the first step teaches the loop
    assert all(type(r) is StepRecord for r in slow)
    assert fast == slow and slow == fast and not (fast[2] != slow[2])
    assert fast[2] != slow[3] and fast[2] != "a step"
    assert tracker.count == slow_tracker.count == 6 and tracker._trained == slow_tracker._trained == {"model"}
    for c, py in zip(fast[1:], slow[1:], strict=True):
        assert (c.index, c.start, c.end, c.samples, c.closures) == (py.index, py.start, py.end, py.samples, py.closures)
        assert c.phases == py.phases and list(c.phases) == list(py.phases)
        assert c.duration == py.duration and c.other == py.other
        assert c.marks is NO_MARKS and not c.marks
    assert fast[1].samples is None and fast[3].samples == 64  # 0 samples reads None, as the Python path says
    with pytest.raises(TypeError):
        hash(fast[1])  # unhashable, like the dataclass


@needs_hot
def test_the_ring_calls_its_alarm_when_it_comes_to_hold_wake_at_events():
    """The publisher sleeps long while a job does not step; the ring wakes it as a burst piles up: once each time
    it comes to hold ``wake_at`` events, whoever appends (Python here, the C hooks in a job)."""
    ring = HOT.Ring(100)
    assert ring.wake is None
    calls: list[int] = []
    ring.wake, ring.wake_at = lambda: calls.append(len(ring)), 3
    for _ in range(10):
        ring.append((1, 0.0, None, None))
    assert calls == [3]  # at the crossing, with the third event already on the ring
    ring.drain()
    for _ in range(4):
        ring.append((1, 0.0, None, None))
    assert calls == [3, 3]

    def broken() -> None:
        raise RuntimeError("the alarm failed")

    ring.drain()
    ring.wake = broken
    for _ in range(5):
        ring.append((1, 0.0, None, None))  # its error never reaches the appending thread
    assert len(ring) == 5
    ring.wake = None
    with pytest.raises(TypeError):
        ring.wake = 3


@needs_hot
def test_the_c_hooks_ring_the_alarm_too():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buf = event_buffer(100_000)
    woken: list[int] = []
    buf.wake, buf.wake_at = lambda: woken.append(len(buf)), 50
    inst = Instrumentation(lambda code, arg=None: buf.append((code, perf_counter(), arg, None)), lambda *a: None)
    inst.install()
    try:
        inst.fast = buf.append
        assert inst.bounds.ring is buf  # the C hooks write there directly
        for _ in range(20):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        inst.uninstall()
    assert woken == [50] and len(buf) > 50


@needs_hot
def test_a_ctrl_c_inside_the_alarm_reaches_the_training_thread_after_the_append():
    """A KeyboardInterrupt raised inside the alarm (a signal handler run in the middle of it) is not swallowed with
    the alarm's other errors: the append is done, and the interrupt comes at the interpreter's next check."""
    import signal

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is handled by something else here")
    ring = HOT.Ring(10)

    def interrupted() -> None:
        raise KeyboardInterrupt

    ring.wake, ring.wake_at = interrupted, 1
    with pytest.raises(KeyboardInterrupt):
        ring.append((1, 0.0, None, None))
        for _ in range(10_000):  # the interpreter checks for signals as it runs
            pass
    assert len(ring) == 1  # the append was done when it came
    ring.wake = lambda: None  # an alarm that returns: nothing comes after
    ring.drain()
    ring.append((1, 0.0, None, None))
    for _ in range(10_000):
        pass


def _records(n: int) -> list[dict[str, Any]]:
    return [{"image": torch.zeros(3, 5 + i % 3, 4), "label": i} for i in range(n)]


@pytest.mark.parametrize("accelerated", [False, pytest.param(True, marks=needs_hot)], ids=["python", "c"])
@pytest.mark.parametrize(("collate", "samples"), [
    ("stacked", 6),  # (x, y): the first tensor's leading dimension
    ("dict", 6),  # {"x": ..., "y": ...}
    ("nested", 6),  # ((x1, x2), y): two views, each (6, ...)
    ("records", 6),  # detectron2's trivial_batch_collator: a list of per-image dicts (3-channel images)
    ("detection", 6),  # torchvision detection's tuple(zip(*batch)): (images of different sizes, target dicts)
    ("dict-and-labels", 6),  # default_collate of (inputs_dict, label) pairs: [batched dict, labels], no records
    ("inputs-and-targets", 6),  # of (inputs_dict, targets_dict) pairs: two batched dicts, other keys
    ("scalar", None),  # a 0-d tensor says nothing
    ("empty", None),
])
def test_a_fetchs_samples_are_its_batch_size_whatever_the_collate(accelerated, collate, samples):
    """The samples of a fetch (samples/s) in C and in Python alike: a batch of per-sample records counted 3 (its
    first image's channels) where the script trains on 6."""
    batch = {
        "stacked": lambda: (torch.zeros(6, 3), torch.zeros(6)),
        "dict": lambda: {"x": torch.zeros(6, 3), "y": torch.zeros(6)},
        "nested": lambda: ((torch.zeros(6, 3), torch.zeros(6, 3)), torch.zeros(6)),
        "records": lambda: _records(6),
        "detection": lambda: (tuple(r["image"] for r in _records(6)), tuple(_records(6))),
        "dict-and-labels": lambda: [{"ids": torch.zeros(6, 5), "mask": torch.ones(6, 5)}, torch.zeros(6)],
        "inputs-and-targets": lambda: [{"ids": torch.zeros(6, 5)}, {"boxes": torch.zeros(6, 4)}],
        "scalar": lambda: torch.tensor(1.0),
        "empty": lambda: [],
    }[collate]
    events: list[tuple[int, Any]] = []
    inst = Instrumentation(lambda code, arg=None: events.append((code, arg)), lambda *a: None, accelerated=accelerated)
    inst.install()
    inst.fast = lambda ev: events.append((ev[0], ev[2]))
    try:
        for _ in DataLoader(range(2), batch_size=1, collate_fn=lambda _: batch()):
            pass
    finally:
        inst.uninstall()
    fetched = [arg[1] for code, arg in events if code == 1 and isinstance(arg, tuple) and arg[0] == "data"
               and arg[1] is not False]
    assert fetched[1:] == [samples, samples]  # after iter(loader)'s
