"""The ``memory_snapshot`` command (key ``m``): N steps of CUDA allocation history, then a snapshot.

Driven by :class:`perfmon.agent.commands.Commands` on the training thread at step boundaries:

* :meth:`MemorySnapshots.begin` (the boundary after the request): when the script does not record
  allocation history itself, turn recording on (``_record_memory_history``); when it does, dump a
  snapshot at once and leave its settings alone: perfmon never changes history it did not start.
* :meth:`MemorySnapshots.boundary`: exactly N boundaries later, dump the snapshot to
  ``RUN/memory/snapshot-step<K>-<unix time>.pickle``, then turn recording off again
  (``_record_memory_history(enabled=None)``, which also frees the recorded history).
* :meth:`MemorySnapshots.finish`: the job ends while recording: save what was recorded, turn it off.

Every torch call goes through ``cuda_memory`` (``torch.cuda.memory`` unless given): the tests drive
this class with a fake one. Nothing here raises into training: a failed torch call is answered
(``ok=False``) and counted with ``record_error``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from perfmon.messages.commands import Command

#: Steps recorded when the request does not say (its ``steps``; the most it may ask for is
#: ``perfmon.messages.commands.MAX_SNAPSHOT_STEPS``, checked when the command is parsed).
DEFAULT_STEPS = 5
#: Alloc/free events kept (a ring buffer: the newest win); each costs a few KB of host memory.
MAX_ENTRIES = 100_000
VIEWER = "pytorch.org/memory_viz"
#: What a torch must have for this command (private APIs: a torch may lack or rename them).
REQUIRED = ("_record_memory_history", "_dump_snapshot")

Answer = Callable[[dict[str, Any]], None]


def requested_steps(command: Command) -> int:
    """The request's ``steps``, or :data:`DEFAULT_STEPS`."""
    return command.steps if command.steps is not None else DEFAULT_STEPS


class MemorySnapshots:
    """One per agent. ``check`` runs on the socket thread; everything else on the training thread."""

    def __init__(self, out_dir: Path, step: Callable[[], int], record_error: Callable[[str, BaseException], None],
                 cuda_memory: Any = None, history_enabled: Callable[[], bool] | None = None) -> None:
        if cuda_memory is None:
            import torch

            cuda_memory = torch.cuda.memory
            # the allocator's own flag (torch >= 2.1; inductor's cudagraph trees read it the same way)
            history_enabled = history_enabled or getattr(torch._C, "_cuda_isHistoryEnabled", None)
        self.memory = cuda_memory
        self.history_enabled = history_enabled
        self.out_dir = out_dir
        self._step = step
        self._record_error = record_error
        #: perfmon turned history recording on and has not turned it off yet
        self.recording = False
        self.steps = 0
        self.left = 0
        self._answer: Answer | None = None

    # -- socket thread ---------------------------------------------------------------------------
    def check(self, command: Command, queued: bool) -> dict[str, Any] | None:
        """The refusal to answer at once (n/a, busy), or None to queue the request."""
        missing = next((name for name in REQUIRED if not hasattr(self.memory, name)), None)
        if missing is not None:
            return {"ok": False, "done": True, "message": f"memory snapshot: n/a (this torch has no {missing})"}
        if self.recording or queued:
            return self._busy()
        return None

    def accepted(self, command: Command) -> dict[str, Any]:
        """The immediate answer to a queued request."""
        steps = requested_steps(command)
        return {"ok": True, "done": False, "steps": steps,
                "message": f"memory snapshot: recording allocation history for {steps} steps…"}

    # -- training thread -------------------------------------------------------------------------
    def begin(self, command: Command, answer: Answer) -> None:
        if self.recording:
            answer(self._busy())
            return
        steps = requested_steps(command)
        try:
            if self._history_already_on():
                path = self._dump()
                answer({"ok": True, "done": True, "path": str(path), "steps": 0,
                        "message": f"memory snapshot saved: {path} (your script already records allocation "
                                   f"history: saved as it is, its recording left on); open it at {VIEWER}"})
                return
            self.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                               max_entries=MAX_ENTRIES)
        except Exception as exc:  # noqa: BLE001 - never into training
            self._failed(answer, exc)
            return
        self.recording, self.steps, self.left, self._answer = True, steps, steps, answer

    def boundary(self) -> None:
        """One more step recorded; after the last one, save the snapshot and stop recording."""
        if not self.recording:
            return
        self.left -= 1
        if self.left <= 0:
            self._save_and_stop(f"{self.steps} steps of allocation history")

    def finish(self) -> None:
        """The job is ending: save what was recorded so far and turn recording off. Never raises."""
        if self.recording:
            try:
                self._save_and_stop(f"the job ended after {self.steps - self.left} of {self.steps} steps")
            except Exception as exc:  # noqa: BLE001 - the agent's own shutdown goes on
                self._record_error("memory_snapshot", exc)

    # -- helpers ---------------------------------------------------------------------------------
    def _busy(self) -> dict[str, Any]:
        left = f" ({self.left} of {self.steps} steps to go)" if self.recording else ""
        return {"ok": False, "done": True,
                "message": f"busy: a memory snapshot is already recording allocation history{left}"}

    def _history_already_on(self) -> bool:
        if self.history_enabled is not None:
            return bool(self.history_enabled())
        # an older torch without the flag: recorded alloc/free events show in the snapshot's traces
        # (turning history off clears them)
        return any(self.memory._snapshot().get("device_traces") or ())

    def _dump(self) -> Path:
        out = self.out_dir / f"snapshot-step{self._step()}-{int(time.time())}.pickle"
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")  # never a half-written .pickle
        try:
            self.memory._dump_snapshot(str(tmp))
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        return out

    def _save_and_stop(self, what: str) -> None:
        answer = self._answer or (lambda fields: None)
        self.recording, self._answer = False, None
        path: Path | None = None
        error: BaseException | None = None
        try:
            path = self._dump()  # first: turning history off drops it
        except Exception as exc:  # noqa: BLE001
            error = exc
        try:
            self.memory._record_memory_history(enabled=None)
        except Exception as exc:  # noqa: BLE001
            self._record_error("memory_snapshot", exc)
            if error is None and path is not None:
                answer({"ok": False, "done": True, "path": str(path),
                        "message": f"memory snapshot saved: {path}, but allocation history could not be turned "
                                   f"off: {type(exc).__name__}: {exc}"})
                return
        if error is not None:
            self._failed(answer, error)
            return
        answer({"ok": True, "done": True, "path": str(path), "steps": self.steps - max(self.left, 0),
                "message": f"memory snapshot saved: {path} ({what}); open it at {VIEWER}"})

    def _failed(self, answer: Answer, exc: BaseException) -> None:
        self._record_error("memory_snapshot", exc)
        answer({"ok": False, "done": True, "message": f"memory snapshot failed: {type(exc).__name__}: {exc}"})
