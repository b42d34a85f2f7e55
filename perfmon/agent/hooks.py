"""Auto-instrumentation: the hooks that feed raw events to the agent.

Every hook only appends a tuple to a deque (``emit``). Costs measured in FIELD-NOTES.md:
DataLoader ``__next__`` wrap ~0.4 us, optimizer step hooks ~1.8 us, backward wrap ~2.3 us.
Forward timing hooks only the root module(s): global module hooks are used briefly, during
the first training step, to find the outermost modules called with grad enabled; then they
are removed and per-instance hooks go on the roots alone.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from perfmon.agent.steps import BEGIN, END, NOGRAD_FORWARD, OPTIMIZER_CREATED

Emit = Callable[[int, Any], None]

#: Stop looking for root modules after this many top-level calls (loops with no backward).
_DISCOVERY_CALL_LIMIT = 64


def batch_size(batch: Any) -> int | None:
    """Leading dimension of the first tensor found in a batch (tensor, sequence or mapping)."""
    for _ in range(4):  # nested containers, a few levels deep at most
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.dim() else None
        if isinstance(batch, list | tuple) and batch:
            batch = batch[0]
        elif isinstance(batch, dict) and batch:
            batch = next(iter(batch.values()))
        else:
            return None
    return None


def loader_settings(loader: Any) -> dict[str, Any]:
    """The DataLoader arguments that decide input throughput."""
    return {
        "num_workers": loader.num_workers, "pin_memory": bool(loader.pin_memory),
        "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
        "prefetch_factor": getattr(loader, "prefetch_factor", None), "batch_size": loader.batch_size,
        "dataset": type(loader.dataset).__name__,
    }


class Instrumentation:
    """Installs and removes the patches; one instance per process."""

    def __init__(self, emit: Emit, on_error: Callable[[str, BaseException], None],
                 boundary: Callable[[], None] = lambda: None) -> None:
        self._emit = emit
        self._boundary = boundary
        self._on_error = on_error
        self._undo: list[Callable[[], None]] = []
        self._discovery: list[Any] = []
        self._depth = 0
        self._top_calls = 0
        self._candidates: dict[int, torch.nn.Module] = {}
        self.roots: list[torch.nn.Module] = []
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.loaders: dict[int, dict[str, Any]] = {}
        self._root_ids: set[int] = set()

    # -- install -------------------------------------------------------------------------
    def install(self) -> None:
        self._patch_dataloader()
        self._patch_backward()
        self._hook_optimizer()
        self._patch_grad_scaler()
        self._start_discovery()

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception as exc:  # noqa: BLE001 - never raise at teardown
                self._on_error("uninstall", exc)
        self._undo.clear()
        self._stop_discovery()

    def _patch(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name)
        wrapped = make(original)
        functools.update_wrapper(wrapped, original)
        wrapped.__perfmon_original__ = original  # type: ignore[attr-defined]
        setattr(owner, name, wrapped)
        self._undo.append(lambda: setattr(owner, name, original))

    def _patch_dataloader(self) -> None:
        from torch.utils.data import dataloader

        emit = self._emit

        def make(orig: Callable) -> Callable:
            def __next__(it: Any) -> Any:
                emit(BEGIN, "data")
                n = None
                try:
                    batch = orig(it)
                    try:
                        n = batch_size(batch)
                    except Exception:  # noqa: BLE001 - an odd batch type must not break training
                        n = None
                    return batch
                finally:
                    emit(END, ("data", n))

            return __next__

        self._patch(dataloader._BaseDataLoaderIter, "__next__", make)

        def make_iter(orig: Callable) -> Callable:
            def __iter__(loader: Any) -> Any:
                try:  # once per epoch: what the input-pipeline rules need to say "set num_workers=8"
                    self.loaders[id(loader)] = loader_settings(loader)
                except Exception as exc:  # noqa: BLE001
                    self._on_error("loader", exc)
                return orig(loader)

            return __iter__

        self._patch(dataloader.DataLoader, "__iter__", make_iter)

    def _patch_backward(self) -> None:
        emit = self._emit

        def make(orig: Callable) -> Callable:
            def backward(*args: Any, **kwargs: Any) -> Any:
                if self._discovery:
                    self.finish_discovery()
                emit(BEGIN, "backward")
                try:
                    return orig(*args, **kwargs)
                finally:
                    emit(END, "backward")
                    if not self.optimizers:
                        self._boundary()  # manual updates: a backward is the last thing a step does

            return backward

        self._patch(torch.autograd, "backward", make)

    def _hook_optimizer(self) -> None:
        from torch.optim import optimizer as optim_mod

        emit = self._emit
        boundary = self._boundary

        def post_hook(opt: Any, args: Any, kwargs: Any) -> None:
            emit(END, "optimizer")
            boundary()

        pre = optim_mod.register_optimizer_step_pre_hook(lambda opt, args, kwargs: emit(BEGIN, "optimizer"))
        post = optim_mod.register_optimizer_step_post_hook(post_hook)
        self._undo.append(pre.remove)
        self._undo.append(post.remove)

        def make(orig: Callable) -> Callable:
            def __init__(opt: Any, *args: Any, **kwargs: Any) -> None:
                orig(opt, *args, **kwargs)
                emit(OPTIMIZER_CREATED, None)
                try:
                    self.optimizers.add(opt)
                except TypeError:
                    pass

            return __init__

        self._patch(optim_mod.Optimizer, "__init__", make)

    def _patch_grad_scaler(self) -> None:
        # scaler.step() unscales, checks for inf and may skip optimizer.step(): the whole
        # call is the optimizer phase, so a skipped step still ends the training step.
        scaler_cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if scaler_cls is None:
            return
        emit = self._emit

        def make(orig: Callable) -> Callable:
            def step(scaler: Any, *args: Any, **kwargs: Any) -> Any:
                emit(BEGIN, "optimizer")
                try:
                    return orig(scaler, *args, **kwargs)
                finally:
                    emit(END, "optimizer")

            return step

        self._patch(scaler_cls, "step", make)

    # -- root module discovery -------------------------------------------------------------
    def _start_discovery(self) -> None:
        from torch.nn.modules import module as mod

        emit = self._emit

        def pre(module: torch.nn.Module, args: Any) -> None:
            if self._depth == 0 and id(module) not in self._root_ids:
                # Time this call as the root's instance hooks will time later ones.
                if torch.is_grad_enabled():
                    self._candidates.setdefault(id(module), module)
                else:
                    emit(NOGRAD_FORWARD, None)
                emit(BEGIN, "forward")
                self._top_calls += 1
            self._depth += 1

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._depth = max(0, self._depth - 1)
            if self._depth == 0 and id(module) not in self._root_ids:
                emit(END, "forward")
                if self._top_calls >= _DISCOVERY_CALL_LIMIT:
                    self.finish_discovery()

        self._discovery = [
            mod.register_module_forward_pre_hook(pre),
            mod.register_module_forward_hook(post, always_call=True),
        ]

    def _stop_discovery(self) -> None:
        for handle in self._discovery:
            handle.remove()
        self._discovery = []

    def finish_discovery(self) -> None:
        """Hook the roots found so far and drop the global hooks. Training thread only."""
        if not self._discovery:
            return
        self._stop_discovery()
        for module in self._candidates.values():
            self.hook_root(module)
        self._candidates.clear()

    def hook_root(self, module: torch.nn.Module) -> None:
        """Time every call of ``module`` as a forward phase."""
        if id(module) in self._root_ids:
            return
        emit = self._emit
        self._root_ids.add(id(module))
        self.roots.append(module)

        def pre(mod: torch.nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled():
                emit(NOGRAD_FORWARD, None)
            emit(BEGIN, "forward")

        def post(mod: torch.nn.Module, args: Any, output: Any) -> None:
            emit(END, "forward")

        handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True)]
        self._undo.extend(h.remove for h in handles)

