"""Auto-instrumentation: the hooks that feed raw events to the agent.

Every hook appends a ``(code, perf_counter(), arg, None)`` event to the agent's buffer (``emit``, or ``fast``
straight to it) and asks :class:`Boundaries` whether a step just ended; the common case is inlined in each hook.
Inside a real loop, torch's own work between the hooks leaves their code and data cache-cold, so a hook costs
what it touches more than what it computes (benchmarks/README.md). Where ``perfmon.agent._hot`` was built (a C
compiler at install), the fetch, backward and optimizer hooks and the body of the roots' ``__call__`` wrapper
are its C twins: they read the hot state (``Boundaries``' and ``Commands``' C base structs, ``native.py``)
directly, write compact slots to the agent's C event ring (expanded into the same tuples on the agent's
thread), and call the same ``begin``/``end`` for every other case (tests/test_hot_path.py holds the two equal).

Nothing is left on the user's objects. Forward timing wraps ``__call__`` of the *class* of
each root module and times only the root instances (by identity), so a model pickles,
``torch.save``-s and ``deepcopy``-s exactly as without perfmon, and a copy is never timed
as the model. Roots are found during the first training step by wrapping
``nn.Module.__call__`` (not global module hooks: ``torch.compile`` guards on those and
warns about them); the wrapper steps aside while dynamo traces, so compiled code is the
same as under plain python.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from threading import get_ident
from time import perf_counter
from typing import Any

import torch

from perfmon import paths
from perfmon.agent.native import HOT, accelerator
from perfmon.agent.saves import SAVES
from perfmon.agent.steps import (
    BEGIN,
    BOUNDARY,
    CHECKPOINT,
    CLOSURE,
    COPY,
    END,
    END_BOUNDARY,
    EVALGRAD,
    GRAD,
    NEW_EPOCH_BEGINS,
    NEW_EPOCH_ENDS,
    NEW_EVAL_EPOCH_BEGINS,
    NOGRAD,
    OPTIMIZER_CREATED,
    PREFETCH,
    Boundaries,
)


def grad_kind(mod: Any) -> int:
    """The kind of a forward with grad enabled: EVALGRAD for a module in eval mode (an evaluation that forgot
    ``torch.no_grad()``), else GRAD. The C hot path's ``Forward`` decides the same."""
    return EVALGRAD if getattr(mod, "training", True) is False else GRAD


def is_loss(mod: Any) -> bool:
    """``mod`` is a loss function by its class: a parameter-free ``nn.Module`` of torch's losses, or of a class
    named ``...Loss`` or ``...Criterion``. It is no root: its time is *other*, as a functional loss's is. (A loss
    of another name is known by its first call: ``Instrumentation._scalar_loss``. A module without parameters
    that is not a loss, an augmentation or a model that keeps its weights in plain tensors, is found as any module
    is.)"""
    try:
        inner = getattr(mod, "_orig_mod", mod)  # a compiled loss (torch.compile(criterion)) is its module's
        if not (isinstance(inner, torch.nn.modules.loss._Loss)
                or type(inner).__name__.lower().endswith(("loss", "criterion"))):
            return False
        return not _holds_parameters(mod)
    except Exception:  # noqa: BLE001 - an odd module: found as any module is
        return False


def _holds_parameters(mod: Any) -> bool:
    try:
        return next(iter(mod.parameters()), None) is not None
    except Exception:  # noqa: BLE001 - a module whose parameters() fails: taken for a model
        return True


Emit = Callable[[int, Any], None]

#: Stop looking for roots after this many top-level module calls with no step (inference loops).
_DISCOVERY_CALL_LIMIT = 20_000
#: step ends a discovery started again (a new optimizer over a model no root holds) waits for a new top-level call
_REDISCOVERY_STEPS = 3


def _records(seq: Any) -> bool:
    """Per-sample records: a list or tuple of dicts with the same keys (not ``[inputs_dict, labels]``, nor an
    inputs dict beside a targets dict: default_collate's batches of a dataset of pairs)."""
    if not isinstance(seq, list | tuple) or not seq or not isinstance(seq[0], dict):
        return False
    keys = seq[0].keys()
    return all(isinstance(item, dict) and item.keys() == keys for item in seq[1:])


def batch_size(batch: Any) -> int | None:
    """Leading dimension of the first tensor found in a batch (tensor, sequence or mapping); for a batch of
    per-sample records, their number: a list of dicts (detectron2's, mmdetection's), or a pair whose second item is
    one (torchvision detection's ``images, targets``: a tuple of images of different sizes, a tuple of dicts)."""
    if _records(batch):
        return len(batch)
    if isinstance(batch, list | tuple) and len(batch) >= 2 and isinstance(batch[0], list | tuple) \
            and _records(batch[1]):  # only where the first item is no tensor: (x, y) batches skip the look
        return len(batch[1])
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


def loader_settings(loader: Any, training: bool | None = None) -> dict[str, Any]:
    """The DataLoader arguments that decide input throughput; ``training``: its epoch is one of training."""
    return {
        "num_workers": loader.num_workers, "pin_memory": bool(loader.pin_memory),
        "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
        "prefetch_factor": getattr(loader, "prefetch_factor", None), "batch_size": loader.batch_size,
        "dataset": type(loader.dataset).__name__, "training": training,
    }


#: The attribute under which a wrapper holds the model it runs, as its only child: DDP, DataParallel and DeepSpeed's
#: engine (``module``), ``torch.compile``'s OptimizedModule (``_orig_mod``), FSDP (``_fsdp_wrapped_module``).
_WRAPPED = ("module", "_orig_mod", "_fsdp_wrapped_module")


def wrapped_models(mod: Any) -> list[Any]:
    """The models ``mod`` wraps, outermost first (``torch.compile(DDP(model))``: the DDP, then ``model``): a
    module whose only child is held under one of :data:`_WRAPPED`."""
    out: list[Any] = []
    seen = {id(mod)}
    while True:
        children = getattr(mod, "_modules", None)
        if not isinstance(children, dict) or len(children) != 1:
            return out
        name, inner = next(iter(children.items()))
        if name not in _WRAPPED or not isinstance(inner, torch.nn.Module) or id(inner) in seen:
            return out
        out.append(inner)
        seen.add(id(inner))
        mod = inner


def _compiled_module(mod: Any) -> bool:
    """``mod`` runs compiled code when called: ``torch.compile(model)``'s OptimizedModule, or ``model.compile()``."""
    if mod.__dict__.get("_compiled_call_impl") is not None:
        return True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(mod, optimized)


def _compiling() -> Callable[[], bool]:
    """``torch.compiler.is_compiling`` where it exists (dynamo folds it to True while tracing)."""
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return fn if callable(fn) else (lambda: False)


def _inside_engine(bounds: Any) -> bool:
    """This thread runs inside the autograd engine (a backward called by a reentrant checkpoint's backward, on
    autograd's device thread): its backward is nested, not a thread's own training."""
    try:
        return bounds.engine_node is not None and bounds.engine_node() is not None
    except Exception:  # noqa: BLE001 - never into training
        return False


def _script_target(proc: Any) -> str | None:
    """The name of what a ``multiprocessing`` process runs, where the script wrote it (in the script, or in a module
    beside it); None for what a library runs (DataLoader workers, pools, managers, joblib's workers, a builtin)."""
    target = getattr(proc, "_target", None)
    while isinstance(target, functools.partial):
        target = target.func
    if target is None:  # a Process subclass with its own run()
        cls = type(proc)
        return f"{cls.__qualname__}.run" if _the_scripts(cls.__module__) else None
    if not _the_scripts(getattr(target, "__module__", None)):
        return None
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or "its target"


def _the_scripts(module_name: str | None) -> bool:
    """``module_name`` is the script itself or a module in the script's folder (or below it)."""
    if module_name in (None, ""):
        return False
    if module_name in ("__main__", "__mp_main__"):
        return True
    file = getattr(sys.modules.get(module_name), "__file__", None)
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if not file or not main:
        return False
    folder = os.path.dirname(os.path.abspath(main))
    return os.path.abspath(file).startswith(folder + os.sep) and "site-packages" not in file


class Instrumentation:
    """Installs and removes the patches; one instance per process."""

    def __init__(self, emit: Emit, on_error: Callable[[str, BaseException], None],
                 boundary: Callable[[], None] = lambda: None, accelerated: bool = True, commands: Any = None,
                 warn: Callable[[str], None] = lambda text: None,
                 follow_spawn: Callable[[Any, int], Callable[..., Any]] | None = None) -> None:
        self._emit = emit
        self._warn = warn  # a warning for the recording and the monitors (the agent's)
        #: (fn, nprocs) -> what torch.multiprocessing's processes run instead, each recording as a rank; None: not
        self._follow_spawn = follow_spawn
        #: the C twins of the fetch, backward and optimizer hooks (same events, no Python frame), where built
        self._hot = accelerator() if accelerated else None
        self._boundary = boundary
        self._on_error = on_error
        self._undo: list[Callable[[], None]] = []
        self.bounds = Boundaries()
        self.commands = commands
        self.unavailable: list[str] = []  # what this torch lacks: measured as "not measured"
        #: classes whose __call__ perfmon wrapped: original, wrapper, whether the class defined it itself
        self._calls: dict[type, tuple[Any, Callable, bool]] = {}
        self._lifted = False  # the wrappers are off (_calls_lifted)
        self._discovery_retired = [False]  # the discovery wrapper calls straight on: discovery over, left in place
        self._module_depth = 0  # module calls open on the training thread (discovery only)
        self._top_calls = 0
        #: the loss modules called at top level while discovering (the roots, where no model is found)
        self._losses: dict[int, torch.nn.Module] = {}
        self._in_loss = 0  # calls discovery looks through (_looked_through) open on the training thread
        self._candidates: dict[int, torch.nn.Module] = {}
        #: discovery started again after the first: it ends at a step end once it found a new root (or gave up)
        self._rediscovery_steps: int | None = None
        self._root_params: set[int] = set()  # ids of the roots' parameters, as last counted
        self._said: set[str] = set()  # what the once-a-process warnings have said
        self._root_refs: dict[int, weakref.ref[torch.nn.Module]] = {}
        self.compiled = False  # torch.compile was called: a FLOP count would run a compiled step eagerly
        self._roots: list[weakref.ref[torch.nn.Module]] = []
        self._rooted = False  # discovery found a root once (they may all have died since: a model per trial)
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._optimizer_ids: set[int] = set()  # ids of ``optimizers``: the step hook's cheap "seen it" test
        self.loaders: dict[int, dict[str, Any]] = {}
        # epochs each loader began (weakly: a loop that builds a loader every epoch drops the old ones), and the
        # training loader seen last: a new one after it had run a single epoch was built anew for the epoch
        self._loader_epochs: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._last_training: tuple[str, int, int] | None = None  # (dataset class, its epochs, loaders rebuilt)

    @property
    def commands(self) -> Any:
        """The agent's Commands, whose ``boundary`` is ``boundary``: the C hot path makes its idle check itself."""
        return self.bounds.commands

    @commands.setter
    def commands(self, commands: Any) -> None:
        self.bounds.commands = commands

    @property
    def fast(self) -> Callable[[tuple[int, float, Any, Any]], None] | None:
        """The event buffer's ``append`` while host timing is all there is to record, else None (the agent clears
        it for CUDA marks, at exit and in forked workers; then ``emit`` decides). Kept in ``bounds.sink``; where
        it is a ``_hot.Ring``'s, the C hooks write to that ring directly (``bounds.ring``)."""
        return self.bounds.sink

    @fast.setter
    def fast(self, append: Callable[[tuple[int, float, Any, Any]], None] | None) -> None:
        bounds = self.bounds
        owner = getattr(append, "__self__", None)
        bounds.ring = None
        bounds.sink = append
        if HOT is not None and type(owner) is HOT.Ring:
            bounds.ring = owner

    # -- the one path every hook takes -------------------------------------------------------
    # Kept lean: every training step passes here a few times.
    def begin(self, phase: str, arg: Any = None, key: Any = None) -> None:
        """A phase begins on the training thread (commits the previous step if it is over)."""
        try:
            bounds = self.bounds
            if bounds.depth or not bounds.pending:
                bounds.depth += 1  # nested, or no step waiting to end: nothing to decide (the common case)
            elif bounds.begin(phase, key):
                self._commit()
            fast = bounds.sink
            if fast is not None:
                fast((BEGIN, perf_counter(), phase if arg is None else arg, None))
            else:
                self._emit(BEGIN, phase if arg is None else arg)
        except Exception as exc:  # noqa: BLE001 - never into training
            self._on_error("hooks", exc)

    def end(self, phase: str, arg: Any = None, key: Any = None) -> None:
        try:
            bounds = self.bounds
            depth = bounds.depth
            if depth > 1:
                bounds.depth = depth - 1  # a nested phase ended: only the outermost can end a step
                commit = False
                if phase == "optimizer" and key in bounds.unstepped:  # a wrapped optimizer's own (ZeRO's)
                    bounds.first_update(key)
            elif depth == 1 and phase != "optimizer" and (phase != "backward" or bounds.optimizers_seen):
                bounds.depth = 0  # a forward, fetch or accumulation backward: no step ends here
                commit = False
            else:
                commit = bounds.end(phase, key)
            code = END_BOUNDARY if commit else END
            fast = bounds.sink
            if fast is not None:
                fast((code, perf_counter(), phase if arg is None else arg, None))
            else:
                self._emit(code, phase if arg is None else arg)
            if commit:
                self._committed()
        except Exception as exc:  # noqa: BLE001
            self._on_error("hooks", exc)

    def _commit(self) -> None:
        """A step is over: tell the tracker, end discovery after the first, run pending commands."""
        fast = self.bounds.sink
        if fast is not None:
            fast((BOUNDARY, perf_counter(), None, None))
        else:
            self._emit(BOUNDARY, None)
        self._committed()

    def _committed(self) -> None:
        """After a step boundary was recorded: end discovery after the first step, run pending commands."""
        if self.bounds.discovering:
            self.finish_discovery()
        self._boundary()

    def explicit_step(self) -> None:
        """The script called ``perfmon.step()``: from now on only its calls end steps."""
        self.bounds.explicit = True
        if self.bounds.discovering:
            self.finish_discovery(force=True)

    # -- install -------------------------------------------------------------------------
    def install(self) -> None:
        # the thread that imported torch trains, until a backward elsewhere says otherwise: fetches, forwards and
        # saves on other threads (a prefetching generator, an async checkpoint) overlap the steps, not part of them
        self.bounds.train_thread = get_ident()
        self.bounds.engine_node = getattr(torch._C, "_current_autograd_node", None)
        for name, patch in (("DataLoader", self._patch_dataloader), ("backward", self._patch_backward),
                            ("optimizer", self._hook_optimizer), ("GradScaler", self._patch_grad_scaler),
                            ("torch.save", self._patch_save), ("torch.compile", self._patch_compile),
                            ("torch.multiprocessing.spawn", self._patch_spawn),
                            ("multiprocessing.Process", self._patch_process_start),
                            ("torch.distributed", self._patch_init_process_group),
                            ("the script's own torch.profiler sessions", self._patch_profiler), ("forward", self._start_discovery)):
            try:
                patch()
            except Exception:  # noqa: BLE001 - a torch without this API: that part is not measured (said once)
                self.unavailable.append(name)
        self._find_existing_optimizers()

    def uninstall(self) -> None:
        self.bounds.discovering = False
        for cls in list(self._calls):
            try:
                self._unwrap_call(cls)
            except Exception as exc:  # noqa: BLE001 - never raise at teardown
                self._on_error("uninstall", exc)
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception as exc:  # noqa: BLE001 - never raise at teardown
                self._on_error("uninstall", exc)
        self._undo.clear()

    def _patch(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        had_own = name in vars(owner) if isinstance(owner, type) else True
        original = getattr(owner, name)
        wrapped = make(original)
        functools.update_wrapper(wrapped, original)
        wrapped.__perfmon_original__ = original  # type: ignore[attr-defined]
        setattr(owner, name, wrapped)
        self._undo.append(lambda: setattr(owner, name, original) if had_own else delattr(owner, name))

    # The hooks handle their common case inline (host timing only, no step decision to make): what ``begin`` and
    # ``end`` would do, without the two calls. In a real loop that saves ~2 us a step (an A/B of the hooks before
    # and after, 60 block pairs in one process, on the ~100 us step of benchmarks/agent_cpu.py --job tiny).

    def _patch_dataloader(self) -> None:
        from torch.utils.data import dataloader

        bounds = self.bounds
        hot = self._hot
        if hot is not None:
            def timed(orig: Callable) -> Callable:
                return hot.Timed(orig, self, bounds, "data", hot.DATA, torch.Tensor)

            self._patch(dataloader._BaseDataLoaderIter, "__next__", timed)
            self._patch(dataloader.DataLoader, "__iter__", self._loader_iter)
            return

        def make(orig: Callable) -> Callable:
            def __next__(it: Any) -> Any:
                if bounds.train_thread != get_ident():  # a prefetching thread: it overlaps the steps
                    return self._prefetch(orig, it)
                fast = bounds.sink
                if fast is not None and (bounds.depth or not bounds.pending):
                    bounds.depth += 1
                    try:
                        fast((BEGIN, perf_counter(), "data", None))
                    except Exception as exc:  # noqa: BLE001 - never into training
                        self._on_error("hooks", exc)
                else:
                    self.begin("data")
                bounds.in_data += 1
                n: int | bool | None = False  # False: the fetch raised (StopIteration: the loader is done)
                try:
                    batch = orig(it)
                    try:
                        n = batch_size(batch)
                    except Exception:  # noqa: BLE001 - an odd batch type must not break training
                        n = None
                    return batch
                finally:
                    bounds.in_data -= 1
                    fast = bounds.sink
                    depth = bounds.depth
                    if fast is not None and depth:  # a fetch ends no step while a phase is open
                        bounds.depth = depth - 1
                        try:
                            fast((END, perf_counter(), ("data", n), None))
                        except Exception as exc:  # noqa: BLE001 - never into training
                            self._on_error("hooks", exc)
                    else:
                        self.end("data", ("data", n))

            return __next__

        self._patch(dataloader._BaseDataLoaderIter, "__next__", make)
        self._patch(dataloader.DataLoader, "__iter__", self._loader_iter)

    def _prefetch(self, orig: Callable, it: Any) -> Any:
        """A fetch on a thread that is not the training thread (a prefetching generator): not a phase of the
        steps it overlaps, but how long it took is counted apart (the loop may be waiting for it)."""
        t0 = perf_counter()
        batch = orig(it)
        try:
            t1 = perf_counter()
            try:
                n = batch_size(batch)
            except Exception:  # noqa: BLE001 - an odd batch type must not break training
                n = None
            fast = self.bounds.sink
            if fast is not None:
                fast((PREFETCH, t1, (t1 - t0, n), None))
            else:
                self._emit(PREFETCH, (t1 - t0, n))
        except Exception as exc:  # noqa: BLE001 - never into training
            self._on_error("hooks", exc)
        return batch

    def _loader_iter(self, orig: Callable) -> Callable:
        """``DataLoader.__iter__``, timed as *data* on the training thread: a loader without persistent workers
        starts them here at every epoch, seconds under spawn, which is input time. Its event says that a loader's
        epoch begins, for training or not (``NEW_EPOCH``, ``NEW_EVAL_EPOCH``), so the tracker never takes it for a
        batch: a training loader's is the data of the step whose fetches follow it, with the batches it fetches
        ahead. A prefetching thread's (which overlaps the steps) is left untimed. Python, also with the C hooks:
        once an epoch."""
        bounds = self.bounds

        def timed(loader: Any) -> Any:
            # an evaluation's loader is iterated under no_grad (a kNN monitor's, a validation's); a root's mode says
            # little here (a frozen teacher stays in eval mode, HF's Trainer calls model.train() in the step)
            training = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
            self.begin("data", NEW_EPOCH_BEGINS if training else NEW_EVAL_EPOCH_BEGINS)
            bounds.in_data += 1
            try:
                return orig(loader)
            finally:
                bounds.in_data -= 1
                self.end("data", NEW_EPOCH_ENDS)

        def __iter__(loader: Any) -> Any:
            try:  # once per epoch: what the input-pipeline rules need to say "set num_workers=8"
                settings = loader_settings(loader, self._iterating_for_training())
                if settings["training"]:
                    settings["rebuilt"] = self._rebuilt(loader, settings["dataset"])
                self.loaders.pop(id(loader), None)  # the newest last: a validation loader's epoch is not the last
                self.loaders[id(loader)] = settings  # training loader's
                if len(self.loaders) > 16:  # a new loader every epoch: keep the recent ones
                    del self.loaders[next(iter(self.loaders))]
            except Exception as exc:  # noqa: BLE001
                self._on_error("loader", exc)
            return timed(loader) if bounds.train_thread == get_ident() else orig(loader)

        return __iter__

    def _rebuilt(self, loader: Any, dataset: str) -> int:
        """How many times in a row the training loader was a new one over the same kind of dataset, built after
        the one before had run a single epoch (``DataLoader(...)`` inside the epoch loop: its workers start anew
        every epoch, which ``persistent_workers`` cannot help)."""
        try:
            epochs = self._loader_epochs.get(loader, 0) + 1
            self._loader_epochs[loader] = epochs
        except TypeError:  # a loader subclass without weak references or hashing: not counted
            return 0
        last = self._last_training  # a loader iterated again (its second epoch) was not rebuilt: back to 0
        rebuilt = last[2] + 1 if epochs == 1 and last is not None and last[:2] == (dataset, 1) else 0
        self._last_training = (dataset, epochs, rebuilt)
        return rebuilt

    def _iterating_for_training(self) -> bool:
        """A loader's epoch begins for training: not under no_grad or inference_mode, and no model found so far
        in eval mode (an evaluation loop sets both, Lightning's and Hugging Face's among them)."""
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return False
        return all(root.training for root in self.roots)

    def _patch_backward(self) -> None:
        bounds = self.bounds
        hot = self._hot
        if hot is not None:
            self._patch(torch.autograd, "backward",
                        lambda orig: hot.Timed(orig, self, bounds, "backward", hot.BACKWARD, torch.Tensor))
            return

        def make(orig: Callable) -> Callable:
            def backward(*args: Any, **kwargs: Any) -> Any:
                me = get_ident()  # a backward: this thread trains (not one inside the engine: a checkpoint's)
                if bounds.train_thread != me and not (bounds.in_backward and _inside_engine(bounds)):
                    bounds.thread_returns += bool(bounds.train_thread) and me == bounds.prev_thread
                    bounds.prev_thread, bounds.train_thread = bounds.train_thread, me
                fast = bounds.sink
                if fast is not None and (bounds.depth or not bounds.pending):
                    bounds.depth += 1
                    try:
                        fast((BEGIN, perf_counter(), "backward", None))
                    except Exception as exc:  # noqa: BLE001 - never into training
                        self._on_error("hooks", exc)
                else:
                    self.begin("backward")
                bounds.in_backward += 1
                try:
                    return orig(*args, **kwargs)
                finally:
                    bounds.in_backward -= 1
                    fast = bounds.sink
                    depth = bounds.depth
                    if fast is not None and (depth > 1 or (depth == 1 and bounds.optimizers_seen)):
                        bounds.depth = depth - 1  # nested, or a backward that cannot end a step
                        try:
                            fast((END, perf_counter(), "backward", None))
                        except Exception as exc:  # noqa: BLE001 - never into training
                            self._on_error("hooks", exc)
                    else:
                        self.end("backward")

            return backward

        self._patch(torch.autograd, "backward", make)

    def _hook_optimizer(self) -> None:
        from torch.optim import optimizer as optim_mod

        known = self._optimizer_ids
        bounds = self.bounds

        def pre_hook(opt: Any, args: Any, kwargs: Any) -> tuple[tuple, dict] | None:
            key = id(opt)
            if key not in known:
                self._note_optimizer(opt)
            fast = bounds.sink
            if fast is not None and (bounds.depth or not bounds.pending):
                bounds.depth += 1
                try:
                    fast((BEGIN, perf_counter(), "optimizer", None))
                except Exception as exc:  # noqa: BLE001 - never into training
                    self._on_error("hooks", exc)
            else:
                self.begin("optimizer", key=key)
            if (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None:
                return self.wrap_closure(args, kwargs)  # step(closure): time the closure's own work apart
            return None

        def post_hook(opt: Any, args: Any, kwargs: Any) -> None:
            key = id(opt)
            fast = bounds.sink
            # the loop's one optimizer, at top level: its step ends the training step (Boundaries.end's fast case)
            if fast is not None and key == bounds.single and bounds.depth == 1 and not bounds.explicit:
                try:
                    bounds.depth = 0
                    fast((END_BOUNDARY, perf_counter(), ("optimizer", key), None))
                    if bounds.discovering:
                        self.finish_discovery()
                    self._boundary()
                except Exception as exc:  # noqa: BLE001 - never into training
                    self._on_error("hooks", exc)
            else:
                self.end("optimizer", ("optimizer", key), key)

        hot = self._hot
        if hot is not None:
            pre_hook = hot.OptimizerHook(self, bounds, known, False)  # type: ignore[assignment]
            post_hook = hot.OptimizerHook(self, bounds, known, True)  # type: ignore[assignment]
        pre = optim_mod.register_optimizer_step_pre_hook(pre_hook)
        post = optim_mod.register_optimizer_step_post_hook(post_hook)
        self._undo.append(pre.remove)
        self._undo.append(post.remove)

        def make(orig: Callable) -> Callable:
            def __init__(opt: Any, *args: Any, **kwargs: Any) -> None:
                orig(opt, *args, **kwargs)
                try:
                    seen = self.bounds.optimizers_seen
                    self._note_optimizer(opt)
                    if seen and self.bounds.optimizer_made():  # one built per iteration (or epoch) begins it
                        self._commit()
                except Exception as exc:  # noqa: BLE001 - never into training
                    self._on_error("hooks:optimizers", exc)

            return __init__

        self._patch(optim_mod.Optimizer, "__init__", make)

    def wrap_closure(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        """``optimizer.step(closure)`` (LBFGS, and every step of PyTorch Lightning's automatic optimization): the
        step's ``(args, kwargs)`` with the closure wrapped, or None where it has none. The closure's own work (the
        loss, ``zero_grad``, a framework's hooks) is the script's, as in a plain loop: its ``closure`` phase is
        charged to no phase ("other"), while the forward and backward inside it are forward and backward."""
        try:
            closure = kwargs.get("closure")
            if closure is not None:
                return args, {**kwargs, "closure": self._timed_closure(closure)}
            if len(args) > 1 and args[1] is not None:  # args[0] is the optimizer
                return (args[0], self._timed_closure(args[1]), *args[2:]), kwargs
        except Exception as exc:  # noqa: BLE001 - never into training
            self._on_error("hooks", exc)
        return None

    def _timed_closure(self, closure: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(closure):  # the optimizer's own error, as without perfmon
            return closure
        mark = self._closure_mark

        @functools.wraps(closure, updated=())  # its name and docs; never a copy of a callable object's attributes
        def timed_closure(*args: Any, **kwargs: Any) -> Any:
            mark(BEGIN)
            try:
                return closure(*args, **kwargs)
            finally:
                mark(END)

        return timed_closure

    def _closure_mark(self, code: int) -> None:
        """A closure begins or ends: an event only (it nests in the optimizer's step: no step boundary here)."""
        try:
            fast = self.bounds.sink
            if fast is not None:
                fast((code, perf_counter(), CLOSURE, None))
            else:
                self._emit(code, CLOSURE)
        except Exception as exc:  # noqa: BLE001 - never into training
            self._on_error("hooks", exc)

    def _note_optimizer(self, opt: Any) -> None:
        if opt in self.optimizers:
            return
        try:
            self.optimizers.add(opt)
            key = id(opt)
            self._optimizer_ids.add(key)
            # an id is reused once its optimizer dies; a loop that replaced its optimizer has one again. (The
            # callbacks hold the two sets of ints, never self: that would keep every optimizer alive.)
            weakref.finalize(opt, self._optimizer_ids.discard, key)
            weakref.finalize(opt, self.bounds.keys.discard, key)
            self.bounds.unstepped.add(key)
            weakref.finalize(opt, self.bounds.unstepped.discard, key)
        except TypeError:
            pass
        if not self.bounds.optimizers_seen:  # from now on a backward does not end a step
            self.bounds.optimizers_seen = True
            self._emit(OPTIMIZER_CREATED, None)
        elif self._rooted and not self.bounds.discovering and self._trains_outside_roots(opt):
            self._rediscover()

    def _trains_outside_roots(self, opt: Any) -> bool:
        """``opt`` updates parameters no root module holds: a model the script built after the first (fine-tuning a
        new head after pre-training, a second stage), whose class no root wrapper times."""
        try:
            params = [id(p) for group in opt.param_groups for p in group["params"]]
            if all(key in self._root_params for key in params):
                return False
            self._root_params = {id(p) for root in self.roots for p in root.parameters()}  # roots may have grown
            return not all(key in self._root_params for key in params)
        except Exception:  # noqa: BLE001 - an optimizer without the usual param_groups: nothing to learn from it
            return False

    def _rediscover(self) -> None:
        """Look for the roots again over the next steps: the loop trains a model no root wrapper times (its
        forwards would be *other*)."""
        self._candidates.clear()
        self._top_calls = 0
        self._rediscovery_steps = _REDISCOVERY_STEPS
        self._start_discovery()

    def _say_once(self, topic: str, text: Callable[[], str | None]) -> None:
        """A warning about ``topic``, once a process: ``text()`` says what (None: nothing to say, ask next time).
        Never raises into the script's call it is made from."""
        if topic in self._said:
            return
        try:
            said = text()
        except Exception as exc:  # noqa: BLE001 - never into training
            self._on_error(f"hooks:{topic}", exc)
            return
        if said is not None:
            self._said.add(topic)
            self._warn(said)

    def _patch_spawn(self) -> None:
        """``torch.multiprocessing.spawn`` (the DDP tutorial's launcher) trains in fresh processes that perfmon does
        not follow: say so once, with what does follow them, instead of a run that simply shows no steps."""
        spawn_mod = importlib.import_module("torch.multiprocessing.spawn")  # the name, not torch.multiprocessing.spawn()

        def said(fn: Any, nprocs: int) -> str:
            name = getattr(fn, "__name__", "its function")
            return (f"torch.multiprocessing started {nprocs} process(es) running {name}(): perfmon follows this "
                    "process only, so their steps are not recorded here. To monitor them, start the ranks with "
                    f"`perfmon torchrun` instead, or call perfmon.instrument() at the top of {name}() (a recording "
                    "per process, listed by `perfmon ls`)")

        def make(orig: Callable) -> Callable:
            def start_processes(fn: Any, args: Any = (), nprocs: int = 1, *rest: Any, **kwargs: Any) -> Any:
                ranks = None
                if self._follow_spawn is not None:
                    try:
                        ranks = self._follow_spawn(fn, nprocs)
                    except Exception as exc:  # noqa: BLE001 - never into training: they run unfollowed
                        self._on_error("spawn", exc)
                if ranks is None:
                    self._say_once("spawn", lambda: said(fn, nprocs))
                    return orig(fn, args, nprocs, *rest, **kwargs)
                return orig(ranks, args, nprocs, *rest, **kwargs)

            return start_processes

        self._patch(spawn_mod, "start_processes", make)
        patched = spawn_mod.start_processes
        mp = importlib.import_module("torch.multiprocessing")
        if getattr(mp, "start_processes", None) is patched.__perfmon_original__:
            self._patch(mp, "start_processes", lambda orig: patched)  # the name the package exports too

    def _patch_process_start(self) -> None:
        """A script that trains in a ``multiprocessing.Process`` of its own (to isolate a run, or a GPU) showed no
        steps and a hint about custom loops. A process the script starts before any step of its own, with a target
        of its own (not a DataLoader worker, a pool's or a manager's), gets a warning once."""
        process_mod = importlib.import_module("multiprocessing.process")

        def said(proc: Any) -> str | None:
            name = _script_target(proc)
            return None if name is None else (
                f"the script started a process running {name}() before any training step of its own: perfmon "
                "follows this process only, so if that one trains, its steps are not recorded here. To monitor it, "
                f"call perfmon.instrument() at the top of {name}() (a recording of its own, listed by `perfmon ls`)")

        def make(orig: Callable) -> Callable:
            def start(proc: Any) -> Any:
                if not getattr(self.commands, "boundaries", 0):
                    self._say_once("process", lambda: said(proc))
                return orig(proc)

            return start

        self._patch(process_mod.BaseProcess, "start", make)

    def _patch_init_process_group(self) -> None:
        """A job that makes its other ranks itself (PyTorch Lightning's DDP runs the script again in a subprocess
        per rank): perfmon follows the process it started only. Say so once, with what follows every rank."""
        import torch.distributed as dist

        if not dist.is_available() or not paths.launched_alone():
            return

        def said() -> str | None:
            world, rank = dist.get_world_size(), dist.get_rank()
            return None if world <= 1 else (
                f"torch.distributed: this process is rank {rank} of {world}, and perfmon follows this process "
                f"only: the other {world - 1} rank(s) run without perfmon and their steps are not recorded. To "
                f"monitor every rank, start the job with `perfmon torchrun --nproc_per_node {world} SCRIPT [ARGS]` "
                "(PyTorch Lightning and accelerate take their ranks from torchrun's environment when they find it)")

        def make(orig: Callable) -> Callable:
            def init_process_group(*args: Any, **kwargs: Any) -> Any:
                out = orig(*args, **kwargs)
                self._say_once("distributed", said)
                return out

            return init_process_group

        self._patch(dist, "init_process_group", make)

    def _find_existing_optimizers(self) -> None:
        """``perfmon.instrument()`` after the optimizer was built: find the ones that exist."""
        try:
            optimizer_cls = torch.optim.Optimizer

            def found() -> list[Any]:
                # type(), not isinstance(): isinstance reads __class__, which some lazy objects answer with a warning
                return [obj for obj in gc.get_objects() if issubclass(type(obj), optimizer_cls)]

            if found():
                # gc.get_objects() also returns garbage not yet collected: an optimizer that died in a reference
                # cycle would read as "this loop has an optimizer" and stop a backward from ending a step of a
                # loop with manual updates. One collection, only where there is a candidate.
                gc.collect()
                for obj in found():
                    self._note_optimizer(obj)
        except Exception as exc:  # noqa: BLE001
            self._on_error("hooks:optimizers", exc)

    def _patch_grad_scaler(self) -> None:
        # scaler.step() unscales, checks for inf and may skip optimizer.step(): the whole
        # call is the optimizer phase, so a skipped step still ends the training step.
        scaler_cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if scaler_cls is None:
            scaler_cls = torch.cuda.amp.GradScaler  # older torch: only the CUDA one

        def make(orig: Callable) -> Callable:
            def step(scaler: Any, optimizer: Any = None, *args: Any, **kwargs: Any) -> Any:
                key = id(optimizer)
                self.begin("optimizer", key=key)
                try:
                    return orig(scaler, optimizer, *args, **kwargs)
                finally:
                    self.end("optimizer", ("optimizer", key), key)

            return step

        self._patch(scaler_cls, "step", make)

    def _timed_save(self, orig: Callable) -> Callable:
        """``orig`` (a save to a file) timed as *checkpoint* when the training thread calls it."""
        def save(*args: Any, **kwargs: Any) -> Any:
            if self.bounds.train_thread != get_ident():  # an async checkpoint: it overlaps the steps
                return orig(*args, **kwargs)
            self.begin(CHECKPOINT)
            try:
                return orig(*args, **kwargs)
            finally:
                self.end(CHECKPOINT)

        return save

    def _patch_save(self) -> None:
        self._patch(torch, "save", self._timed_save)
        self.patch_saves()

    def patch_saves(self) -> None:
        """The saves of :data:`SAVES` whose modules are fully imported, timed as torch.save is: now, or when the
        module's import ends (``bootstrap``'s import hooks, there before the module's own ``import torch``, so
        that ``from safetensors.torch import save_file`` binds the timed one)."""
        if not self._undo:
            return  # not installed, or uninstalled (nothing to undo): an import after the agent finished
        for module_name, attrs in SAVES.items():
            module = sys.modules.get(module_name)
            for path in attrs if module is not None else ():
                *outer, name = path.split(".")
                owner = functools.reduce(lambda obj, attr: getattr(obj, attr, None), outer, module)
                save = getattr(owner, name, None)
                if callable(save) and not hasattr(save, "__perfmon_original__"):
                    self._patch(owner, name, self._timed_save)

    def _patch_profiler(self) -> None:
        """The script's own profiler sessions, for perfmon's windows to give way to (``agent.profiler_guard``):
        every torch.profiler session runs on a legacy profiler object, from its ``_prepare_trace`` to its
        ``__exit__``; ``emit_nvtx`` (ranges for Nsight Systems) and ``emit_itt`` (VTune) hold the profiler from
        their ``__enter__``, where enabled."""
        guard = getattr(self.commands, "script_profilers", None)
        if guard is None:
            return
        import torch.autograd.profiler as legacy

        def opening(orig: Callable) -> Callable:
            def _prepare_trace(prof: Any, *args: Any, **kwargs: Any) -> Any:
                if getattr(prof, "enabled", True):
                    try:
                        guard.opening(prof)
                    except Exception as exc:  # noqa: BLE001 - the script's profiler starts whatever perfmon's does
                        self._on_error("profiler", exc)
                return orig(prof, *args, **kwargs)

            return _prepare_trace

        def closing(orig: Callable) -> Callable:
            def __exit__(prof: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    return orig(prof, *args, **kwargs)
                finally:
                    guard.closed(prof)

            return __exit__

        self._patch(legacy.profile, "_prepare_trace", opening)
        self._patch(legacy.profile, "__exit__", closing)
        for name in ("emit_nvtx", "emit_itt"):
            annotations = getattr(legacy, name, None)
            if annotations is not None:
                self._patch(annotations, "__enter__", opening)
                self._patch(annotations, "__exit__", closing)

    # -- module __call__ wrappers: discovery, then the roots' classes ---------------------------
    def _wrap_call(self, cls: type, make: Callable[[Callable], Callable]) -> None:
        """Replace ``cls.__call__`` (kept in ``_calls`` so it can be lifted and put back)."""
        had_own = "__call__" in vars(cls)
        original = cls.__call__
        wrapped = make(original)
        functools.update_wrapper(wrapped, original)
        self._calls[cls] = (original, wrapped, had_own)
        cls.__call__ = wrapped  # type: ignore[method-assign]

    def _unwrap_call(self, cls: type) -> bool:
        """Take perfmon's wrapper off ``cls.__call__``; False where one of the script's stays on top of it."""
        original, wrapped, had_own = self._calls.pop(cls)
        return self._put_back(cls, original, wrapped, had_own)

    @staticmethod
    def _put_back(cls: type, original: Callable, wrapped: Callable, had_own: bool) -> bool:
        """``cls.__call__`` as it was before perfmon's wrapper, if that wrapper is still what it is: one the script
        put there since (a tracer of its own wrapping ``nn.Module.__call__``) stays, and so does ours under it,
        which passes calls through once discovery is over. Returns whether it put the original back."""
        if vars(cls).get("__call__") is not wrapped:
            return False
        if had_own:
            cls.__call__ = original  # type: ignore[method-assign]
        else:
            delattr(cls, "__call__")
        return True

    @contextlib.contextmanager
    def _calls_lifted(self) -> Iterator[None]:
        """Plain ``__call__`` everywhere while torch.compile builds a module: it captures
        ``module.__call__`` and would otherwise compile perfmon's wrapper as the user's frame. Reentrant (a compiled
        module called inside another's call): only the outermost puts the wrappers back."""
        if self._lifted:
            yield
            return
        lifted = [(cls, wrapped, vars(cls).get("__call__")) for cls, (original, wrapped, had_own) in self._calls.items()
                  if self._put_back(cls, original, wrapped, had_own)]
        self._lifted = True
        try:
            yield
        finally:
            self._lifted = False
            for cls, wrapped, put_back in lifted:
                if cls in self._calls and vars(cls).get("__call__") is put_back:  # none of the script's since
                    cls.__call__ = wrapped  # type: ignore[method-assign]

    def _patch_compile(self) -> None:
        def make(orig: Callable) -> Callable:
            def compile(*args: Any, **kwargs: Any) -> Any:
                with self._calls_lifted():
                    result = orig(*args, **kwargs)
                self.compiled = True
                model = args[0] if args else kwargs.get("model")
                try:  # compiled after discovery: the compiled module is timed as its model was
                    if isinstance(result, torch.nn.Module) and self._is_root(model):
                        self.hook_root(result)
                except Exception as exc:  # noqa: BLE001
                    self._on_error("hooks:compile", exc)
                if model is None or isinstance(model, torch.nn.Module) or not callable(result):
                    return result  # a module, or the decorator torch.compile(**options) returns (it calls this)
                return self._lifted_while_discovering(result)

            return compile

        self._patch(torch, "compile", make)

    def _lifted_while_discovering(self, compiled: Callable) -> Callable:
        """A compiled function (``@torch.compile def train_step``) that calls the model: dynamo traces it during
        step 1 and would inline discovery's wrapper on the submodules' ``nn.Module.__call__`` and guard on it; once
        discovery put the plain one back, it recompiled. Called while discovering, it runs with the plain one."""
        compiling = _compiling()
        bounds = self.bounds

        @functools.wraps(compiled)
        def run(*args: Any, **kwargs: Any) -> Any:
            if compiling() or not bounds.discovering or bounds.train_thread != get_ident():
                return compiled(*args, **kwargs)
            with self._calls_lifted():
                return compiled(*args, **kwargs)

        return run

    def runs_compiled(self) -> bool:
        """The script compiled something (``torch.compile``), or a model it trains is compiled (``model.compile()``)."""
        return self.compiled or any(_compiled_module(root) for root in self.roots)

    def _root_class_call(self, mod: torch.nn.Module) -> None:
        """A top-level call of a root's class while discovering (again: a new optimizer): an instance that is no root
        is a candidate, like any module's call (the next fold's or trial's model, of the same class, which the
        class's root wrapper times but discovery would never see: its wrapper is not called for it)."""
        try:
            if not self._module_depth and not self._is_root(mod) and torch.is_grad_enabled():
                self._candidates.setdefault(id(mod), mod)
                self._top_calls += 1
        except Exception as exc:  # noqa: BLE001 - never into training
            self._on_error("hooks:discovery", exc)

    def _forget_root(self, key: int, ref: weakref.ref[torch.nn.Module]) -> None:
        """A root was freed: its id may be the next model's (CPython reuses the memory of a model of the same size,
        a new one per fold or trial), which discovery would then take for the dead root's and never find."""
        try:
            if self._root_refs.get(key) is ref:
                del self._root_refs[key]
            self._roots.remove(ref)
        except Exception:  # noqa: BLE001 - a weakref callback must not raise (python prints it on stderr)
            pass

    def _is_root(self, module: Any) -> bool:
        ref = self._root_refs.get(id(module))
        return ref is not None and ref() is module

    def _start_discovery(self) -> None:
        compiling = _compiling()
        inst = self
        bounds = self.bounds
        # set once discovery is over where the wrapper could not be taken out (the script wrapped it since): calls
        # that still pass through it go straight on, as if it were gone
        retired = self._discovery_retired = [False]

        def make(original: Callable) -> Callable:
            def plain_inside(mod: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
                # A compiled module (torch.compile(model), model.compile()): dynamo traces its forward now and
                # inlines the submodules' nn.Module.__call__, guarding on what it finds there. It must find the
                # plain one, as after discovery: finding this wrapper, it recompiled once discovery put the plain
                # one back (an extra recompile; an error under set_stance("fail_on_recompile")).
                with inst._calls_lifted():
                    return original(mod, *args, **kwargs)

            def __call__(mod: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
                if compiling() or retired[0]:  # compiling first, alone: dynamo folds it and reads nothing of ours
                    return original(mod, *args, **kwargs)
                if bounds.train_thread != get_ident():  # another thread's calls: not the loop's, and they must
                    return original(mod, *args, **kwargs)  # not make the training thread's look nested
                call = plain_inside if _compiled_module(mod) else original
                if (not bounds.discovering or inst._module_depth or bounds.in_data or bounds.in_root
                        or bounds.in_backward):
                    inst._module_depth += 1
                    try:
                        return call(mod, *args, **kwargs)
                    finally:
                        inst._module_depth -= 1
                key = id(mod)
                new = key not in inst._root_refs and key not in inst._candidates
                if new and inst._looked_through(mod, key):
                    inst._in_loss += 1
                    try:
                        return call(mod, *args, **kwargs)
                    finally:
                        inst._in_loss -= 1
                # A top-level module call: time it as the root's wrapper will time later ones.
                kind = grad_kind(mod) if torch.is_grad_enabled() else NOGRAD
                if key not in inst._root_refs:
                    inst._candidates.setdefault(key, mod)
                    inst._top_calls += 1
                inst.begin("forward", ("forward", key, kind), kind)
                inst._module_depth += 1
                try:
                    out = call(mod, *args, **kwargs)
                finally:
                    inst._module_depth -= 1
                    inst.end("forward")
                    if inst._top_calls >= _DISCOVERY_CALL_LIMIT:
                        inst.finish_discovery(force=True)
                if new and inst._scalar_loss(mod, key, out):
                    inst._candidates.pop(key, None)
                    inst._losses[key] = mod
                return out

            return __call__

        self._wrap_call(torch.nn.Module, make)
        self.bounds.discovering = True

    def _looked_through(self, mod: Any, key: int) -> bool:
        """Discovery calls ``mod`` (no root yet, no candidate) through, untimed: a loss, whose calls are still top
        level (a network it holds without registering it is found), or, inside a loss, a module without parameters
        (a Dice loss's Sigmoid, a DETR matcher: the loss's time). A loss called again while no module with
        parameters has been is the loop's only module (a model of plain tensors, updated by hand): timed, so that
        its calls begin the iterations."""
        if key in self._losses or is_loss(mod):
            if self._losses and not self._candidates and not self._roots:
                return False
            self._losses.setdefault(key, mod)
            return True
        return self._in_loss > 0 and not _holds_parameters(mod)

    def _scalar_loss(self, mod: Any, key: int, out: Any) -> bool:
        """A loss of a class not named one (timm's ``SoftTargetCrossEntropy``): its first call gave a scalar, it
        holds no parameters, and a model was found beside it (alone, it may be the loop's whole step)."""
        return (isinstance(out, torch.Tensor) and out.dim() == 0
                and bool(self._roots or any(k != key for k in self._candidates)) and not _holds_parameters(mod))

    def _stop_discovery(self) -> None:
        if self.bounds.discovering:
            self.bounds.discovering = False
            if torch.nn.Module in self._calls and not self._unwrap_call(torch.nn.Module):
                self._discovery_retired[0] = True

    def finish_discovery(self, force: bool = False) -> None:
        """Time the roots found so far and unwrap ``nn.Module.__call__``; called at each step end while discovering.
        Training thread only. A discovery started again waits, unless ``force``d, for a step that found a new root
        (it began inside the step whose optimizer was new, after that step's forward)."""
        if not self.bounds.discovering:
            return
        left = self._rediscovery_steps
        if left is not None and not force and not self._candidates and left > 0:
            self._rediscovery_steps = left - 1
            return
        self._rediscovery_steps = None
        try:
            self._stop_discovery()
            # no model found, only a loss (a model of plain tensors): the loss is timed, as the loop's one module
            found = self._candidates or ({} if self._roots else self._losses)
            for module in found.values():
                self.hook_root(module)
        except Exception as exc:  # noqa: BLE001
            self._on_error("hooks:discovery", exc)
        self._candidates.clear()
        self._losses.clear()

    def hook_root(self, module: torch.nn.Module) -> None:
        """Time every call of ``module`` (that instance only) as a forward phase; and the top-level calls of the
        model a wrapper root runs (``torch.compile``'s, DDP's), as a copy's: an evaluation that calls the unwrapped
        model (HF's ``Trainer`` with ``torch_compile``, a DDP loop evaluating ``model.module``) is seen as one."""
        if self._is_root(module):
            return
        key = id(module)
        ref = weakref.ref(module, lambda dead: self._forget_root(key, dead))
        self._root_refs[key] = ref
        self._roots.append(ref)
        self._rooted = True
        self._time_calls(type(module))
        for inner in wrapped_models(module):
            self._time_calls(type(inner))  # not a root: under no_grad its calls are a copy's (COPY)

    def _time_calls(self, cls: type) -> None:
        """Time the top-level calls of ``cls``'s instances as forward phases (those inside another timed call, a
        root's or a wrapper's, are its own)."""
        if cls in self._calls:
            return
        roots = self._root_refs
        compiling = _compiling()
        grad_enabled = torch.is_grad_enabled
        inst = self
        bounds = self.bounds

        hot = self._hot
        if hot is not None:  # the body in C; the wrapper stays Python code, which torch.compile inlines
            forward = hot.Forward(self, bounds, roots, grad_enabled)

            def make_hot(orig: Callable) -> Callable:
                def __call__(mod: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
                    if compiling():  # first, alone (see discovery)
                        return orig(mod, *args, **kwargs)
                    return forward(orig, mod, args, kwargs)

                return __call__

            self._wrap_call(cls, make_hot)
            return

        def make(orig: Callable) -> Callable:
            def __call__(mod: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
                if compiling():  # first, alone (see discovery)
                    return orig(mod, *args, **kwargs)
                if bounds.in_root or bounds.in_data or bounds.in_backward or bounds.train_thread != get_ident():
                    return orig(mod, *args, **kwargs)
                if bounds.discovering:
                    inst._root_class_call(mod)
                key = id(mod)
                if grad_enabled():
                    kind = grad_kind(mod)
                else:  # another instance of the model's class: a copy (EMA) or a sibling
                    ref = roots.get(key)
                    kind = NOGRAD if ref is not None and ref() is mod else COPY
                fast = bounds.sink
                if fast is not None and (bounds.depth or not bounds.pending):
                    bounds.depth += 1
                    try:
                        fast((BEGIN, perf_counter(), ("forward", key, kind), None))
                    except Exception as exc:  # noqa: BLE001 - never into training
                        inst._on_error("hooks", exc)
                else:
                    inst.begin("forward", ("forward", key, kind), kind)
                bounds.in_root += 1
                try:
                    return orig(mod, *args, **kwargs)
                finally:
                    bounds.in_root -= 1
                    fast = bounds.sink
                    depth = bounds.depth
                    if fast is not None and depth:  # a forward ends no step while a phase is open
                        bounds.depth = depth - 1
                        try:
                            fast((END, perf_counter(), "forward", None))
                        except Exception as exc:  # noqa: BLE001 - never into training
                            inst._on_error("hooks", exc)
                    else:
                        inst.end("forward")

            return __call__

        self._wrap_call(cls, make)

    @property
    def roots(self) -> list[torch.nn.Module]:
        """The root modules still alive (held weakly: perfmon never keeps a model alive)."""
        return [m for m in (r() for r in self._roots) if m is not None]
