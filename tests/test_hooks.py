"""The hooks on real torch objects, in this process: what they leave behind and what they see."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from perfmon.agent.hooks import Instrumentation, accelerator, is_loss, wrapped_models
from perfmon.agent.steps import BEGIN, BOUNDARY, END, PREFETCH, StepTracker


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[int, Any]] = []
        self.errors: list[tuple[str, BaseException]] = []
        self.boundaries = 0

    def emit(self, code: int, arg: Any = None) -> None:
        self.events.append((code, arg))

    def forwards(self) -> list[Any]:
        return [a for c, a in self.events if c == BEGIN and isinstance(a, tuple) and a[0] == "forward"]

    def steps(self) -> int:
        tracker = StepTracker()
        t = 0.0
        n = 0
        for code, arg in self.events:
            t += 0.001
            n += tracker.feed(code, t, arg) is not None
        return n + (tracker.finish() is not None)


@pytest.fixture
def hooks() -> Iterator[tuple[Instrumentation, Recorder]]:
    rec = Recorder()

    def boundary() -> None:
        rec.boundaries += 1

    inst = Instrumentation(rec.emit, lambda where, exc: rec.errors.append((where, exc)), boundary)
    inst.install()
    try:
        yield inst, rec
    finally:
        inst.uninstall()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_a_timed_model_pickles_saves_and_deepcopies_like_an_untouched_one(hooks):
    inst, rec = hooks
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, 3)
    assert inst.roots == [model]
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    buf = io.BytesIO()
    torch.save(model, buf)  # raised "Can't pickle local object" when hooks were closures on the instance
    assert pickle.loads(pickle.dumps(model)) is not None
    clone = copy.deepcopy(model)
    before = len(rec.forwards())
    with torch.no_grad():
        clone(torch.randn(2, 4))
    kinds = [a[2] for a in rec.forwards()[before:]]
    assert kinds == [2], "a copy is reported as a copy (evaluation), never as the model"


def test_a_model_saved_under_perfmon_loads_in_a_process_without_perfmon(hooks, tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, 2)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    code = ("import sys, torch; m = torch.load(sys.argv[1], weights_only=False); "
            "print(len(m._forward_hooks) + len(m._forward_pre_hooks), 'perfmon' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "False"]


def test_discovery_finds_teacher_and_skips_dataset_transforms_and_long_evaluation(hooks):
    inst, rec = hooks

    class Transformed(Dataset):
        def __init__(self) -> None:
            self.transform = nn.Sequential(nn.Identity())

        def __len__(self) -> int:
            return 400

        def __getitem__(self, i: int) -> torch.Tensor:
            return self.transform(torch.randn(4))

    student, teacher = mlp(), mlp().requires_grad_(False)
    loader = DataLoader(Transformed(), batch_size=2)
    with torch.no_grad():  # an evaluation pass of more than the old 64-call limit before training
        for _ in range(100):
            student(torch.randn(2, 4))
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    for i, x in enumerate(loader):
        with torch.no_grad():
            target = teacher(x)
        loss = (student(x) - target).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i == 4:
            break
    roots = inst.roots
    assert any(r is student for r in roots) and any(r is teacher for r in roots)
    assert not any(r is loader.dataset.transform for r in roots)
    assert rec.steps() == 5


def test_a_loss_module_is_no_root_and_what_it_calls_is_found(hooks):
    """A loss module without parameters (torch's, or a class named ...Loss) is *other*, as a functional loss: it
    is no root, so its forward with grad in an evaluation that forgot ``no_grad`` starts no step, and a loop with
    one keeps the steady shape (one forward a step). A network it calls without registering it is found."""
    inst, rec = hooks

    class FeatureLoss(nn.Module):  # a perceptual loss holding its feature net outside its parameters
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.__dict__["net"] = net

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return (self.net(a) - self.net(b)).pow(2).mean()

    model, features = mlp(), nn.Linear(1, 3).requires_grad_(False)
    criterion, perceptual = nn.MSELoss(), FeatureLoss(features)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        out = model(torch.randn(2, 4))
        loss = criterion(out, torch.zeros(2, 1)) + perceptual(out, torch.zeros(2, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert inst.roots == [model, features]
    assert {a[1] for a in rec.forwards()} == {id(model), id(features)}, "neither loss is a forward"
    assert rec.steps() == 3


def test_a_loss_not_named_one_is_known_by_its_scalar_once_the_model_is_found(hooks):
    """timm's ``SoftTargetCrossEntropy`` (an ``nn.Module``, no ``Loss`` in its name): its first call, beside the
    model, gives a scalar from a module without parameters: no root from then on. A parameter-free module that
    returns the loss and is all there is (a train-step wrapper holding the model unregistered) stays the root."""
    inst, rec = hooks

    class SoftTargetCrossEntropy(nn.Module):
        def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return torch.sum(-target * torch.log_softmax(x, dim=-1), dim=-1).mean()

    model, loss_fn = nn.Linear(4, 3), SoftTargetCrossEntropy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        loss_fn(model(torch.randn(2, 4)), torch.full((2, 3), 1 / 3)).backward()
        opt.step()
        opt.zero_grad()
    assert inst.roots == [model]
    keys = [a[1] for a in rec.forwards()]
    assert keys.count(id(loss_fn)) == 1 and keys.count(id(model)) == 4, "timed in step 1 only, while discovering"
    assert rec.steps() == 4


def test_a_parameter_free_step_that_returns_the_loss_alone_stays_the_root(hooks):
    inst, rec = hooks

    class TrainStep(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.__dict__["model"] = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x).pow(2).mean()

    model = mlp()
    step = TrainStep(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        step(torch.randn(2, 4)).backward()
        opt.step()
        opt.zero_grad()
    assert inst.roots == [step]
    assert rec.steps() == 4


def test_a_loss_is_the_root_where_no_model_is_found(hooks):
    """Plain-tensor weights, a DataLoader, an optimizer and a loss module: the fetch ends step 1 before the loss is
    called again, and discovery ended with nothing found (no forward, validation folded into steps). The loss is
    then the root, as before; one built anew every iteration counts as the same loss."""
    inst, rec = hooks
    w = torch.randn(4, 1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    criterion = nn.BCEWithLogitsLoss()
    loader = DataLoader(TensorDataset(torch.randn(12, 4), torch.rand(12, 1)), batch_size=2)
    for x, y in loader:
        criterion(x @ w, y).backward()
        opt.step()
        opt.zero_grad()
    assert inst.roots == [criterion]
    assert rec.steps() == 6


def test_a_loss_built_every_iteration_still_begins_the_iterations(hooks):
    inst, rec = hooks
    w = torch.randn(4, 1, requires_grad=True)
    for _ in range(6):
        nn.MSELoss()(torch.randn(2, 4) @ w, torch.zeros(2, 1)).backward()  # a new module, maybe a new id, each time
        with torch.no_grad():
            w -= 0.1 * w.grad
        w.grad = None
    assert rec.steps() == 6


def test_the_modules_a_loss_calls_are_its_own_unless_they_are_a_network(hooks):
    """A Dice loss's ``nn.Sigmoid`` (a DETR matcher, a CosineSimilarity) is the loss's time, no root: as a root its
    grad forward in an evaluation that forgot ``no_grad`` read as training. A compiled loss is a loss."""
    inst, rec = hooks

    class DiceLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.Sigmoid()

        def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            p = self.act(logits)
            return 1 - (2 * (p * target).sum() + 1) / (p.sum() + target.sum() + 1)

    model, criterion = mlp(), DiceLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        criterion(model(torch.randn(2, 4)), torch.ones(2, 1)).backward()
        opt.step()
        opt.zero_grad()
    assert inst.roots == [model]


class _Compiled(nn.Module):
    """What ``torch.compile(module)`` returns, as far as ``is_loss`` reads it (an OptimizedModule: ``_orig_mod``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner


def test_a_compiled_loss_is_a_loss():
    assert is_loss(_Compiled(nn.MSELoss())) and not is_loss(_Compiled(mlp())) and not is_loss(nn.Sigmoid())


def test_a_module_without_parameters_that_is_no_loss_is_found_as_any(hooks):
    """A model that keeps its weights in plain tensors (d2l's "from scratch" chapters) is the model: without it
    as a root, its evaluations had no forward and were folded into the next step."""
    inst, rec = hooks

    class Scratch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.randn(4, 1, requires_grad=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    model, criterion = Scratch(), nn.MSELoss()
    opt = torch.optim.SGD([model.w], lr=0.1)
    for _ in range(3):
        criterion(model(torch.randn(2, 4)), torch.zeros(2, 1)).backward()
        opt.step()
        opt.zero_grad()
    assert inst.roots == [model]
    assert rec.steps() == 3


def test_a_loss_module_that_is_the_loops_only_module_begins_its_iterations(hooks):
    """Plain tensors, a loss module and updates by hand: no module with parameters to find. The loss, called a
    second time, is timed as before, so that each step ends where the next iteration's loss begins (without it:
    one step for the whole run)."""
    inst, rec = hooks
    w = torch.randn(4, 1, requires_grad=True)
    criterion = nn.MSELoss()
    for _ in range(5):
        loss = criterion(torch.randn(2, 4) @ w, torch.zeros(2, 1))
        loss.backward()
        with torch.no_grad():
            w -= 0.1 * w.grad
        w.grad = None
    assert inst.roots == [criterion]
    assert rec.steps() == 5


def test_optimizer_built_before_instrumentation_is_found_and_steps_are_exact():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # before the hooks exist (instrument() late)
    rec = Recorder()
    inst = Instrumentation(rec.emit, lambda *a: None, lambda: setattr(rec, "boundaries", rec.boundaries + 1))
    inst.install()
    try:
        assert opt in inst.optimizers
        train(model, opt, 5)
    finally:
        inst.uninstall()
    assert rec.steps() == 5
    assert rec.boundaries == 5  # one per step (the last at its update), never one per backward


def test_an_optimizer_that_died_in_a_cycle_before_instrumentation_does_not_count():
    """gc.get_objects() returns garbage not yet collected: a dead optimizer must not turn a loop with manual updates
    (where each backward ends a step) into one whose backwards never end a step."""
    import gc

    gc.collect()
    gc.disable()  # the cycle below stays uncollected until the hooks look
    try:
        dead = torch.optim.SGD(mlp().parameters(), lr=0.1)
        dead.me = dead
        del dead
        rec = Recorder()
        inst = Instrumentation(rec.emit, lambda *a: None)
        inst.install()
    finally:
        gc.enable()
    try:
        assert not inst.optimizers and not inst.bounds.optimizers_seen
        model = mlp()
        for x in DataLoader(torch.randn(10, 4), batch_size=2):
            model(x).pow(2).mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
    finally:
        inst.uninstall()
    assert rec.steps() == 5


def test_commands_see_one_boundary_per_gan_batch(hooks):
    inst, rec = hooks
    netD, netG = mlp(), nn.Sequential(nn.Linear(4, 4))
    optD = torch.optim.Adam(netD.parameters())
    optG = torch.optim.Adam(netG.parameters())
    loader = DataLoader(torch.randn(20, 4), batch_size=2)
    for real in loader:
        netD(real).mean().backward()
        fake = netG(torch.randn(2, 4))
        netD(fake.detach()).mean().backward()
        optD.step()
        netD(fake).mean().backward()
        optG.step()
        optD.zero_grad()
        optG.zero_grad()
    assert rec.steps() == 10
    assert rec.boundaries == 10  # the 10th when the loader's last __next__ (StopIteration) begins
    assert [c for c, _ in rec.events].count(BOUNDARY) == 10


def test_uninstall_leaves_torch_as_it_was():
    before = (nn.Module.__call__, nn.Sequential.__dict__.get("__call__"), torch.save, torch.autograd.backward)
    rec = Recorder()
    inst = Instrumentation(rec.emit, lambda *a: None)
    inst.install()
    model = mlp()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    assert "__call__" in nn.Sequential.__dict__  # the root's class is timed
    inst.uninstall()
    after = (nn.Module.__call__, nn.Sequential.__dict__.get("__call__"), torch.save, torch.autograd.backward)
    assert after == before


def test_no_global_module_hooks_ever(hooks):
    from torch.nn.modules import module as mod

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not mod._global_forward_hooks and not mod._global_forward_pre_hooks
    train(model, opt, 3)
    assert not mod._global_forward_hooks and not mod._global_forward_pre_hooks


def test_a_failing_cuda_event_never_reaches_the_training_thread(tmp_path):
    from perfmon.agent.runtime import Agent

    agent = Agent(tmp_path / "run", {"script": "x"}, sample_interval=None)

    def broken() -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    agent._cuda_event = broken
    agent.cuda_marks = True
    agent.emit(BEGIN, "forward")  # must not raise
    agent.emit(END, "forward")
    events = agent.events.drain()
    assert len(events) == 2 and all(e[3] is None for e in events)
    assert agent.errors.get("cuda events") == 1 and agent.cuda_marks is False


def test_no_cuda_event_is_recorded_while_a_stream_captures(monkeypatch):
    from perfmon.agent.cuda_timing import CudaResolver

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: made.append(kw))
    assert CudaResolver.make_event() is None
    assert made == []


def test_a_torch_without_a_private_api_degrades_to_not_measured(monkeypatch):
    from torch.utils.data import dataloader

    monkeypatch.delattr(dataloader, "_BaseDataLoaderIter")  # as if this torch had renamed it
    rec = Recorder()
    errors: list = []
    inst = Instrumentation(rec.emit, lambda *a: errors.append(a))
    inst.install()  # must not raise
    try:
        assert inst.unavailable == ["DataLoader"]
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in DataLoader(torch.randn(8, 4), batch_size=2):  # runs, untimed
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        inst.uninstall()
    assert errors == []
    assert rec.steps() == 4
    assert not any(c == BEGIN and a == "data" for c, a in rec.events)


def test_an_old_torch_is_said_once(tmp_path, capfd):
    from perfmon.agent import bootstrap
    from perfmon.agent.runtime import Agent

    agent = Agent(tmp_path / "run", {"script": "x"}, sample_interval=None)
    bootstrap._warn_old_torch(agent, "2.3.1+cu121", ["DataLoader"])
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "older than the 2.4" in err and "not measured with this torch: DataLoader" in err
    bootstrap._warn_old_torch(agent, "2.13.0+cpu", [])
    assert capfd.readouterr().err == ""


def test_an_optimizer_built_every_iteration_is_one_step_each_and_none_is_kept_alive(hooks):
    """``opt = SGD(...)`` at the top of every iteration: building it begins the iteration (one step per update, not
    all of them merged into one), and the hooks keep no optimizer alive (a loop that makes one per iteration would
    otherwise leak them all)."""
    import gc
    import weakref

    inst, rec = hooks
    model = mlp()
    train(model, torch.optim.Adam(model.parameters(), lr=0.1), 3)  # the loop is learned with a long-lived optimizer
    made = []
    for _ in range(5):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        made.append(weakref.ref(opt))
        train(model, opt, 1)
    del opt
    gc.collect()
    assert rec.steps() == 8 and rec.errors == []
    assert [r for r in made if r() is not None] == []
    assert len(inst.bounds.keys) <= 1  # the dead optimizers' ids are forgotten


@pytest.mark.parametrize("accelerated", [False, pytest.param(True, marks=pytest.mark.skipif(
    accelerator() is None, reason="the C hot path was not built"))], ids=["python", "c"])
def test_a_model_built_after_the_first_is_found_when_its_optimizer_steps(accelerated):
    """Pre-train one model, then train another class of model (a classifier on the frozen encoder) with a new
    optimizer: discovery ran once, in the first step, so the second model's forwards were *other* and its
    parameters were left out of the model's size. A new optimizer over parameters no root holds looks again."""

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    class Head(nn.Module):
        def __init__(self, enc: nn.Module) -> None:
            super().__init__()
            self.enc, self.out = enc, nn.Linear(1, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                z = self.enc(x)
            return self.out(z)

    rec = Recorder()
    inst = Instrumentation(rec.emit, lambda where, exc: rec.errors.append((where, exc)), accelerated=accelerated)
    inst.install()
    try:
        enc = Encoder()
        train(enc, torch.optim.SGD(enc.parameters(), lr=0.1), 4)
        again = torch.optim.SGD(enc.parameters(), lr=0.01)  # a new optimizer for a known model: nothing to find
        train(enc, again, 2)
        assert not inst.bounds.discovering
        head = Head(enc)
        train(head, torch.optim.SGD(head.out.parameters(), lr=0.1), 6)
    finally:
        inst.uninstall()
    assert rec.errors == [] and rec.steps() == 12
    assert [type(r).__name__ for r in inst.roots] == ["Encoder", "Head"]
    # the first step of the new loop has run its forward before its optimizer is seen; the other five are timed
    assert sum(1 for f in rec.forwards() if f[1] == id(head)) >= 5


@pytest.mark.parametrize("accelerated", [False, pytest.param(True, marks=pytest.mark.skipif(
    accelerator() is None, reason="the C hot path was not built"))], ids=["python", "c"])
def test_a_new_model_of_the_same_class_per_fold_is_the_root_in_its_turn(accelerated):
    """k-fold cross-validation, a hyperparameter search: a new model of the same class per fold, the last one freed.
    The new model's calls went through its class's root wrapper, which discovery never saw (no candidate: the model
    facts were of the first fold alone, or of no model at all once it was freed), and a freed root's id, which
    CPython gives the next model of the same size, read as that root's. Every fold's model is the root in its turn,
    and a freed one is no root."""
    import gc

    rec = Recorder()
    inst = Instrumentation(rec.emit, lambda where, exc: rec.errors.append((where, exc)), accelerated=accelerated)
    inst.install()
    try:
        for fold in range(4):
            model = mlp()
            train(model, torch.optim.Adam(model.parameters(), lr=0.1), 3)
            assert inst.roots == [model], f"fold {fold}"
            del model
            gc.collect()
            assert inst.roots == []
    finally:
        inst.uninstall()
    assert rec.errors == [] and rec.steps() == 12
    assert inst._root_refs == {}  # every freed root forgotten: its id may be the next model's


@pytest.mark.parametrize("accelerated", [False, pytest.param(True, marks=pytest.mark.skipif(
    accelerator() is None, reason="the C hot path was not built"))], ids=["python", "c"])
def test_fetches_and_saves_on_other_threads_overlap_the_steps_instead_of_joining_them(accelerated, tmp_path):
    """A prefetching thread (prefetch_generator's BackgroundGenerator, as many repos vendor it) fetches while the
    training thread steps, and an executor saves checkpoints meanwhile: neither touches the training thread's
    steps (before, their phases nested into its own and merged steps), and every step is counted."""
    import queue
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils.data import DataLoader, TensorDataset

    rec = Recorder()
    inst = Instrumentation(rec.emit, lambda where, exc: rec.errors.append((where, exc)), accelerated=accelerated)
    inst.install()
    try:
        loader = DataLoader(TensorDataset(torch.randn(160, 4), torch.randn(160, 1)), batch_size=8)
        batches: queue.Queue[Any] = queue.Queue(4)

        def prefetch() -> None:
            for batch in loader:
                batches.put(batch)
            batches.put(None)

        threading.Thread(target=prefetch, daemon=True).start()
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with ThreadPoolExecutor(1) as pool:
            while (batch := batches.get()) is not None:
                x, y = batch
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                pool.submit(torch.save, model.state_dict(), tmp_path / "ckpt.pt")
    finally:
        inst.uninstall()
    assert rec.errors == []
    assert rec.steps() == 20
    phases = [a[0] if isinstance(a, tuple) else a for c, a in rec.events if c == BEGIN]
    assert "data" not in phases and "checkpoint" not in phases  # all on the other threads
    assert phases.count("backward") == 20
    # how long the prefetching thread fetched is counted apart: one event a batch (StopIteration ends none)
    fetched = [a for c, a in rec.events if c == PREFETCH]
    assert len(fetched) == 20 and all(isinstance(a, tuple) and a[0] > 0 and a[1] == 8 for a in fetched), fetched[:3]


def test_safetensors_save_file_is_a_checkpoint_on_the_training_thread_only(tmp_path):
    """safetensors' save_file, imported before the hooks went in, is timed as torch.save is (a save on another
    thread overlaps the steps), and uninstall puts the original back."""
    import threading

    import safetensors.torch

    rec = Recorder()
    inst = Instrumentation(rec.emit, lambda where, exc: rec.errors.append((where, exc)), lambda: None)
    inst.install()
    try:
        assert hasattr(safetensors.torch.save_file, "__perfmon_original__")
        from safetensors.torch import save_file  # bound after install, as a script's own import is

        save_file({"w": torch.zeros(4)}, str(tmp_path / "a.safetensors"))
        worker = threading.Thread(target=save_file, args=({"w": torch.ones(4)}, str(tmp_path / "b.safetensors")))
        worker.start()
        worker.join()
    finally:
        inst.uninstall()
    assert [(c, a) for c, a in rec.events if a == "checkpoint"] == [(BEGIN, "checkpoint"), (END, "checkpoint")]
    assert safetensors.torch.load_file(str(tmp_path / "b.safetensors"))["w"].tolist() == [1.0] * 4
    assert rec.errors == []
    assert not hasattr(safetensors.torch.save_file, "__perfmon_original__")
    inst.patch_saves()  # an import hook that fires after the agent finished patches nothing
    assert not hasattr(safetensors.torch.save_file, "__perfmon_original__")


def test_a_frameworks_whole_save_is_one_checkpoint_and_a_missing_one_is_skipped(monkeypatch):
    """A Trainer's checkpoint method (a class attribute path in SAVES) is timed whole, its torch.save nested in it,
    and a save this version of the library lacks is passed over without an error."""
    import types

    from perfmon.agent import hooks as hooks_module

    class Trainer:
        def _save_checkpoint(self, buf: io.BytesIO) -> str:
            torch.save({"w": torch.zeros(2)}, buf)
            return "saved"

    fake = types.ModuleType("pm_fake_trainer")
    fake.Trainer = Trainer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pm_fake_trainer", fake)
    monkeypatch.setattr(hooks_module, "SAVES", {"pm_fake_trainer": ("Trainer._save_checkpoint", "Gone.save")})
    rec = Recorder()
    inst = Instrumentation(rec.emit, lambda where, exc: rec.errors.append((where, exc)), lambda: None)
    inst.install()
    try:
        assert Trainer()._save_checkpoint(io.BytesIO()) == "saved"
    finally:
        inst.uninstall()
    assert [(c, a) for c, a in rec.events if a == "checkpoint"] == [
        (BEGIN, "checkpoint"), (BEGIN, "checkpoint"), (END, "checkpoint"), (END, "checkpoint")]
    assert rec.errors == [] and not hasattr(Trainer._save_checkpoint, "__perfmon_original__")


def test_a_forked_child_that_starts_its_own_agent_drops_everything_of_its_parents():
    """instrument() in a forked child: the parent's patches go, and so does its wait for ``import torch`` (a parent
    that never imported torch left it in sys.meta_path: both agents then hooked torch, every hook ran twice)."""
    import sys
    from types import SimpleNamespace

    from perfmon import _api
    from perfmon.agent import bootstrap

    inherited = SimpleNamespace(instrumentation=None)
    other = SimpleNamespace(instrumentation=None)
    waits = [bootstrap._ImportHook(inherited, "torch", bootstrap.install_hooks),  # type: ignore[arg-type]
             bootstrap._ImportHook(other, "torch", bootstrap.install_hooks)]  # type: ignore[arg-type]
    sys.meta_path[:0] = waits
    try:
        bootstrap.forget_inherited(inherited)  # type: ignore[arg-type]
        assert waits[0] not in sys.meta_path and waits[1] in sys.meta_path
        assert _api.get_agent() is None
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if f not in waits]


def test_lifting_the_call_wrappers_nests(hooks):
    """A compiled module called inside another's call during discovery lifts the wrappers again: the inner lift
    put them back while the outer call still ran (dynamo would trace them), or failed deleting a __call__ that a
    root's class no longer had (an AttributeError into the script)."""
    inst, _ = hooks

    class Root(nn.Module):
        def forward(self, x):
            return x

    root = Root()
    inst.hook_root(root)
    assert "__call__" in vars(Root) and nn.Module.__call__ is not inst._calls[nn.Module][0]
    with inst._calls_lifted():
        with inst._calls_lifted():
            pass
        assert "__call__" not in vars(Root)  # still plain after the inner exit
        assert nn.Module.__call__ is inst._calls[nn.Module][0]
    assert "__call__" in vars(Root) and nn.Module.__call__ is not inst._calls[nn.Module][0]


def test_module_calls_on_another_thread_during_step_1_leave_the_models_forward_found(hooks):
    """A module running on another thread (an augmentation model, a background evaluator) kept discovery's shared
    nesting count above 0, so the training thread's top-level calls looked nested: no root, no forward time, all
    run long."""
    import threading

    inst, rec = hooks
    busy, stop = nn.Linear(64, 64), threading.Event()
    inside = threading.Event()

    class Slow(nn.Module):
        def forward(self, x):
            inside.set()
            while not stop.is_set():
                busy(x)
            return x

    worker = threading.Thread(target=lambda: Slow()(torch.randn(2, 64)), daemon=True)
    worker.start()
    assert inside.wait(10)
    try:
        model = mlp()
        train(model, torch.optim.SGD(model.parameters(), lr=0.1), 3)
    finally:
        stop.set()
        worker.join(10)
    assert any(m is model for m in inst.roots)


def test_the_loader_an_evaluation_iterates_is_not_taken_for_the_training_loader(hooks):
    """A validation loader (iterated under no_grad, or with the model in eval mode) is marked as such, and the
    training loader stays the one the input rules and the model view describe, however the epochs interleave."""
    from perfmon.messages import LoaderSettings, training_loader
    from perfmon.messages.base import records

    inst, _ = hooks
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
    val_loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    test_loader = DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=1)
    for _epoch in range(2):
        model.train()
        for (x,) in train_loader:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        model.eval()  # Hugging Face's evaluation loop: eval mode, no_grad inside each prediction step
        for (x,) in val_loader:
            with torch.no_grad():
                model(x)
    model.train()
    with torch.no_grad():  # a test pass with the model left in train mode
        for (x,) in test_loader:
            model(x)
    settings = list(inst.loaders.values())
    assert [(s["batch_size"], s["training"]) for s in settings] == [(2, True), (4, False), (1, False)]
    assert training_loader(records(LoaderSettings, settings)).batch_size == 2


@pytest.mark.parametrize("rebuild", [False, True], ids=["one-loader", "a-new-loader-each-epoch"])
def test_a_training_loader_built_anew_every_epoch_is_counted(hooks, rebuild):
    """``DataLoader(...)`` inside the epoch loop starts its workers again every epoch, which persistent_workers
    cannot help: the settings count the rebuilds in a row (an evaluation's loader between them does not reset it)."""
    inst, _ = hooks
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(8, 4))
    loader = DataLoader(data, batch_size=2)
    val_loader = DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=4)
    for _epoch in range(4):
        if rebuild:
            loader = DataLoader(data, batch_size=2)
        for (x,) in loader:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            for (x,) in val_loader:
                model(x)
    training = [s for s in inst.loaders.values() if s["training"]]
    assert training[-1]["rebuilt"] == (3 if rebuild else 0)


@pytest.mark.parametrize("training, picked", [
    ((), None),
    ((None,), 0),  # a recording from before perfmon said which loader trains: the newest, as it was
    ((None, None), 1),
    ((True, False), 0),
    ((True, False, False), 0),
    ((False, True), 1),
    ((True, True, False), 1),  # a second stage's training loader
    ((False, False), 1),  # evaluation only: the newest still says what the input pipeline is
])
def test_training_loader_is_the_newest_not_iterated_for_an_evaluation(training, picked):
    from perfmon.messages import LoaderSettings, training_loader

    loaders = tuple(LoaderSettings(batch_size=i, training=t) for i, t in enumerate(training))
    got = training_loader(loaders)
    assert (got.batch_size if got else None) == picked


def test_an_evaluation_of_the_model_a_wrapper_trains_is_outside_the_steps(hooks):
    """Training calls a wrapper (DDP, DataParallel, torch.compile's OptimizedModule), the evaluation the model it
    wraps, under no_grad inside a loader iterated with grad enabled (HF's ``evaluation_loop``; its Trainer with
    ``torch_compile``): the model's own calls were not timed, so each evaluation's fetches and samples joined the
    next step (16 + 1024 samples, a critical input-bound). They are a copy's calls now: an evaluation."""
    inst, rec = hooks
    model = mlp()
    wrapper = nn.DataParallel(model)  # on a CPU: calls the model it wraps, as DDP does
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=2)
    val_loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    for _epoch in range(2):
        for i, (x,) in enumerate(train_loader):
            wrapper(x).sum().backward()
            opt.step()
            opt.zero_grad()
            if i in (3, 6):
                model.eval()
                for (v,) in val_loader:
                    with torch.no_grad():
                        model(v)
                model.train()
    tracker, records, t = StepTracker(), [], 0.0
    for code, arg in rec.events:
        t += 0.001
        if (record := tracker.feed(code, t, arg)) is not None:
            records.append(record)
    if (record := tracker.finish()) is not None:
        records.append(record)
    assert rec.errors == [] and inst.roots == [wrapper]
    assert len(records) == 16 and [r.samples for r in records] == [2] * 16
    assert sum(1 for f in rec.forwards() if f[1] == id(model)) == 4 * 4  # the evaluations' calls, timed


def test_the_models_wrappers_run_are_found_through_any_nesting():
    model = mlp()
    ddp_like = nn.DataParallel(model)
    compiled = _Compiled(ddp_like)  # torch.compile(ddp_like)'s shape (importing dynamo here warns 14 times)
    assert wrapped_models(compiled) == [ddp_like, model] and wrapped_models(model) == []

    class Holder(nn.Module):  # a model with one child under another name is no wrapper
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp()

    assert wrapped_models(Holder()) == []
