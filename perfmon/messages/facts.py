"""``hello`` and ``model`` messages: facts about the run and the model, sent whole or in pieces."""

from __future__ import annotations

from dataclasses import dataclass, field

from perfmon.messages.base import CONVERT, Message, records
from perfmon.messages.telemetry import GpuSample


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Message):
    """The run: what runs, where, on what. A later hello updates the fields it carries (``merged``)."""

    script: str | None = None
    module: bool | None = None  # ``-m module``
    argv: tuple[str, ...] = ()
    cwd: str | None = None
    pid: int | None = None
    start: float | None = None  # wall clock, seconds
    run_dir: str | None = None
    python: str | None = None  # the interpreter's path (its version in some recordings)
    python_version: str | None = None
    torch: str | None = None
    cuda: bool | None = None  # None until the job has imported torch
    host: str | None = None
    rank: int | None = None  # one process of a multi-process job (torchrun's RANK)
    local_rank: int | None = None
    world_size: int | None = None
    node: int | None = None  # torchrun's GROUP_RANK: which machine of the job
    peak_tflops: float | None = None  # --peak-tflops
    window_peaks: bool | None = None
    gpus: tuple[GpuSample, ...] = ()  # the visible GPUs' static facts
    gpu_reason: str | None = None  # why there is no GPU; None when there are (or before the sampler looked)
    gpu: str | None = None  # a device name given by the launcher
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @property
    def received(self) -> bool:
        """A hello has come."""
        return bool(self.given)

    @property
    def gpus_probed(self) -> bool:
        """The sampler looked for GPUs: ``gpu_reason`` was sent (None when it found some)."""
        return "gpu_reason" in self.given


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerFlags:
    """How one optimizer applies its update (:func:`perfmon.agent.sampler.model_facts`)."""

    name: str | None = None
    fused: bool | None = None
    foreach: bool | None = None  # None: torch's default (foreach where every parameter is on CUDA)
    differentiable: bool | None = None
    devices: tuple[str, ...] = ()  # where its parameters are (``cuda``, ``cpu``)
    param_tensors: int | None = None
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderSettings:
    """The DataLoader arguments that decide input throughput."""

    num_workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    prefetch_factor: int | None = None
    batch_size: int | None = None
    dataset: str | None = None  # the dataset's class name
    # its epoch began with grad enabled and every model in train mode: the loader the steps fetch from, not an
    # evaluation's (None: not known, a recording from before perfmon said so)
    training: bool | None = None
    # a training loader built anew for its epoch this many times in a row, each after the last had run one epoch
    # (``DataLoader(...)`` inside the epoch loop); None: not known (a recording from before perfmon counted it)
    rebuilt: int | None = None
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @property
    def built_every_epoch(self) -> bool:
        """Built anew for its epoch twice in a row or more: the loop builds it inside its epoch loop."""
        return (self.rebuilt or 0) >= 2


CONVERT["tuple[OptimizerFlags, ...]"] = lambda v: records(OptimizerFlags, v)
CONVERT["tuple[LoaderSettings, ...]"] = lambda v: records(LoaderSettings, v)


#: :func:`children_name`'s answers
LOADER_WORKERS, CHILDREN, WORKERS_AND_CHILDREN = ("DataLoader workers", "child processes",
                                                  "DataLoader workers and other child processes")


def children_name(children: int | None, loaders: tuple[LoaderSettings, ...]) -> str:
    """What the trainer's child processes are, in words: "DataLoader workers" where the loaders' workers account for
    all of them; "child processes" where no loader has workers (a rank a framework started, a script's own
    subprocess); else both (wandb's service or multiprocessing's resource tracker beside the workers)."""
    workers = sum(loader.num_workers or 0 for loader in loaders)  # a validation loader's may be alive too
    if not workers:
        return CHILDREN
    return LOADER_WORKERS if not children or children <= workers else WORKERS_AND_CHILDREN


def training_loader(loaders: tuple[LoaderSettings, ...]) -> LoaderSettings | None:
    """The loader the training steps fetch from: the newest not iterated for an evaluation, else the newest."""
    for loader in reversed(loaders):
        if loader.training is not False:
            return loader
    return loaders[-1] if loaders else None


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo(Message):
    """Model facts; they come in pieces (parameters and memory, later FLOPs) that ``merged`` joins."""

    roots: tuple[str, ...] = ()  # the top-level modules' class names
    params: float | None = None
    trainable: float | None = None
    frozen: float | None = None
    by_dtype: dict[str, float] | None = None  # parameter count by dtype
    param_bytes: float | None = None
    grad_bytes: float | None = None
    optimizer_bytes: float | None = None  # optimizer state
    static_bytes: float | None = None  # parameters + gradients + optimizer state
    optimizers: tuple[str, ...] = ()
    optimizer_flags: tuple[OptimizerFlags, ...] = ()
    loaders: tuple[LoaderSettings, ...] = ()  # the newest last
    flops_per_step: float | None = None
    flops_counted_at: float | None = None
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
