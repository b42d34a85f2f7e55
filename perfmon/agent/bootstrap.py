"""Starting and stopping the agent inside a process, and installing hooks once torch is imported.

Hooks need torch, but importing torch before the user's script runs could change what the
script sees (environment variables it sets before ``import torch``). So the hooks go in
right after the script's own ``import torch`` completes, through a one-shot import hook.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from perfmon import _api, paths
from perfmon.agent import exits, own_frames, own_threads
from perfmon.agent.runtime import Agent
from perfmon.agent.saves import SAVES
from perfmon.agent.say import say

#: A process the job spawned, recording as one of its ranks (``spawned.run_rank``): the job's dir, this rank and
#: the world size. It writes its summaries itself (the launcher may follow another of the script's spawns).
Rank = tuple[Path, int, int]


def _meta(target: str, argv: list[str], module: bool, run_dir: Path, rank: Rank | None = None) -> dict[str, Any]:
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    where = paths.placement() if rank is None else {"rank": rank[1], "local_rank": rank[1], "world_size": rank[2],
                                                    "node": 0}
    return {
        "script": target, "module": module, "argv": argv, "cwd": os.getcwd(), "pid": os.getpid(),
        "start": time.time(), "run_dir": str(run_dir), "python": sys.executable,
        "python_version": sys.version.split()[0], "torch": torch_version, "cuda": None,
        "host": socket.gethostname(), "rank": where["rank"], "local_rank": where["local_rank"],
        "world_size": where["world_size"], "node": where["node"],
        "peak_tflops": float(os.environ["PERFMON_PEAK_TFLOPS"]) if os.environ.get("PERFMON_PEAK_TFLOPS") else None,
        "window_peaks": os.environ.get("PERFMON_WINDOW_PEAKS") != "0",
    }


def _run_dir(target: str) -> Path:
    """PERFMON_RUN_DIR (the launcher's choice) or a new dir; one rank of a multi-process job records in
    ``rank-K/`` of the job's dir, which all its ranks name alike."""
    where = paths.placement()
    given = os.environ.get("PERFMON_RUN_DIR")
    alone = paths.launched_alone()
    if given and not alone and os.environ.get(paths.LAUNCHER_ENV) and os.environ.get(paths.RANKS_ENV) != "1":
        # a process the job started (perfmon.instrument() in a torch.multiprocessing.spawn worker) inherits the
        # job's environment, not its run dir: a recording of its own, never lines in the job's
        given = None
    # `perfmon train.py` launched one process: its recording goes where the launcher reads it, whatever
    # RANK/WORLD_SIZE the environment happens to hold (a shell inside a Slurm step)
    if (given and alone) or not paths.is_ranked(where):
        return Path(given) if given else paths.default_run_dir(target, claim=True)
    job = Path(given) if given else paths.job_run_dir(target, str(where["job_id"]), started=_launcher_start())
    rank_dir = paths.rank_dir(job, int(where["rank"] or 0))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart.isdigit() and int(restart) > 0:  # torchrun restarted the workers: a new recording beside the old
        rank_dir = rank_dir.with_name(f"{rank_dir.name}.restart{restart}")
    return rank_dir.absolute()  # discovery files carry it: `perfmon attach` may run from anywhere


def _launcher_start() -> float | None:
    """When the process that started this rank (torchrun's agent, Slurm's step) started: every rank it
    started names the same job dir, and the next job with the same id a new one."""
    try:
        import psutil

        return float(psutil.Process(os.getppid()).create_time())
    except Exception:  # noqa: BLE001 - the name falls back to today's date
        return None


def start_agent(target: str, argv: list[str], module: bool = False, rank: Rank | None = None) -> Agent | None:
    """Create and start the agent; returns None (and says why) if it cannot start. ``rank``: this process is one
    the job spawned, recording as that rank of it."""
    try:
        run_dir = _run_dir(target) if rank is None else paths.rank_dir(rank[0], rank[1])
        interval = paths.sample_interval(os.environ)
        # the launcher that started this process samples the host and GPUs from outside it and sends the readings
        fed = os.environ.get("PERFMON_SAMPLER") == "launcher" and os.environ.get(paths.LAUNCHER_ENV) == str(
            os.getppid())
        meta = _meta(target, argv, module, run_dir, rank)
        os.environ.pop(paths.SOLE_RANK_ENV, None)  # the processes this one starts are not rank 0
        agent = Agent(run_dir, meta, sample_interval=interval if interval > 0 else None, fed=fed)
        agent.start()
    except Exception as exc:  # noqa: BLE001 - without an agent the script still runs
        say(f"perfmon: agent could not start ({exc}); running the script unmonitored")
        return None
    _api.set_agent(agent)
    if "torch" in sys.modules:
        install_hooks(agent)
    else:
        sys.meta_path.insert(0, _ImportHook(agent, "torch", install_hooks))
    for name in SAVES:  # each imports torch itself: the hooks are in when its import ends
        if name not in sys.modules:
            sys.meta_path.insert(0, _ImportHook(agent, name, _patch_saves))
    exits.install_sigterm(agent, finish_agent)
    exits.install_self_kill(agent, finish_agent)
    exits.install_os_exit(agent, finish_agent)
    exits.install_exec(agent)
    exits.install_own_session(agent)
    own_threads.hide()
    own_frames.hide_wrappers()  # a warning's stacklevel, a caught traceback: as without perfmon's wrappers
    return agent


def install_hooks(agent: Agent) -> None:
    """Patch torch for auto-instrumentation; errors disable it, never the script."""
    if agent.instrumentation is not None:
        return
    try:
        from perfmon.agent.commands import Commands
        from perfmon.agent.hooks import Instrumentation

        agent.commands = Commands(agent, _profile_config())
        agent.commands.read_torch_threads()  # on the thread that imported torch: the script's, as a rule
        # the commands' own boundary check, called straight from the hooks at every step end (not via the agent)
        follow_spawn = None
        if agent.meta.get("rank") is None:  # a job's own ranks are not followed again
            from perfmon.agent import spawned

            follow_spawn = functools.partial(spawned.follow, agent)
        inst = Instrumentation(agent.emit, agent.record_error, agent.commands.boundary, commands=agent.commands,
                               warn=agent.warn, follow_spawn=follow_spawn)
        inst.install()
        agent.instrumentation = inst
        torch = sys.modules["torch"]
        agent.meta["torch"] = getattr(torch, "__version__", agent.meta.get("torch"))
        _warn_old_torch(agent, str(agent.meta["torch"]), inst.unavailable)
    except Exception as exc:  # noqa: BLE001
        agent.record_error("hooks", exc)
        say(f"perfmon: could not instrument torch ({exc}); use perfmon.step() to mark steps")


def _patch_saves(agent: Agent) -> None:
    if agent.instrumentation is not None:
        try:
            agent.instrumentation.patch_saves()
        except Exception as exc:  # noqa: BLE001 - its saves are then the next step's time, as before
            agent.record_error("hooks", exc)


#: The oldest torch perfmon supports (pyproject.toml's "torch" extra says the same).
MIN_TORCH = (2, 4)


def _warn_old_torch(agent: Agent, version: str, unavailable: list[str]) -> None:
    """Say once (stderr and the recording) what an old torch leaves unmeasured; the job runs on regardless."""
    try:
        parts = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        parts = MIN_TORCH
    notes = []
    if parts < MIN_TORCH:
        notes.append(f"torch {version} is older than the {MIN_TORCH[0]}.{MIN_TORCH[1]} perfmon supports")
    if unavailable:
        notes.append(f"not measured with this torch: {', '.join(unavailable)}")
    if notes:
        text = "perfmon: " + "; ".join(notes)
        say(text)
        agent.warn(text)


def _profile_config() -> dict[str, Any]:
    """Profiler settings the launcher passes through the environment."""
    env = os.environ
    wait, warmup, active = (int(x) for x in (env.get("PERFMON_PROFILE_SCHEDULE") or "1,1,3").split(","))
    return {
        "wait": wait, "warmup": warmup, "active": active,
        "every": int(env.get("PERFMON_PROFILE_EVERY") or 0),
        "interval": float(env.get("PERFMON_PROFILE_INTERVAL") or 0),
        "count_flops": env.get("PERFMON_COUNT_FLOPS") == "1",
        "profile_memory": env.get("PERFMON_PROFILE_MEMORY") == "1",
        "profile_keep": int(keep) if (keep := env.get("PERFMON_PROFILE_KEEP") or "").isdigit() else None,
    }


class _ImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of the module ``name`` so that ``then(agent)`` runs right after its
    import (torch: the hooks install right after ``import torch``).

    It stays on ``sys.meta_path`` until the module is actually executed: ``importlib.util.find_spec("torch")``
    alone (transformers' and datasets' ``is_torch_available``, run by ``import datasets`` before ``import torch``)
    finds a spec that is never loaded, and a hook that left at the first lookup never saw the real import (0
    steps)."""

    def __init__(self, agent: Agent, name: str, then: Callable[[Agent], None]) -> None:
        self.agent = agent
        self.name = name
        self.then = then
        self.installed = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.name or self.installed:
            return None
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is not self and find is not None:
                spec = find(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            if self.installed:
                return
            self.installed = True
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            self.then(self.agent)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def forget_inherited(agent: Agent) -> None:
    """In a forked child that starts an agent of its own: lift the patches of the parent's agent, which came along
    with the fork (silenced, its threads gone), so that the child's own hooks are the only ones."""
    try:
        if agent.instrumentation is not None:
            agent.instrumentation.uninstall()
        sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, _ImportHook) and f.agent is agent)]
        exits.reset_inherited()
    except Exception as exc:  # noqa: BLE001 - the child's own agent starts regardless
        say(f"perfmon: could not lift the parent's hooks ({exc})")
    _api.set_agent(None)


def finish_agent(agent: Agent | None, exit_info: dict[str, Any]) -> None:
    """Flush, record the exit and close; safe to call twice."""
    if agent is None or getattr(agent, "_finished", False):
        return
    agent._finished = True  # type: ignore[attr-defined]
    try:
        if agent.instrumentation is not None:
            agent.instrumentation.uninstall()
        agent.finish(exit_info)
    except Exception as exc:  # noqa: BLE001
        say(f"perfmon: agent shutdown error: {exc}")
    _api.set_agent(None)
