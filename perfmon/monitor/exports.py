"""What a monitor exports besides its screen: the Prometheus endpoint and the scalar loggers, started
before the job and fed the monitor's state once it has one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from perfmon.analysis.job import JobState
from perfmon.analysis.rules import Config
from perfmon.analysis.state import RunState
from perfmon.messages.commands import Command


class Exports:
    """The ``--prometheus`` endpoint and the ``--tensorboard``/``--wandb`` loggers of one monitor."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def watch(self, lock: threading.Lock, state: Callable[[], RunState | None] | None = None,
              job: JobState | None = None, cfg: Config | None = None,
              send: Callable[[Command], bool] | None = None) -> None:
        """From now on, export this monitor's state (``state()``) or job; ``send`` reaches the job's agents."""
        for item in self.items:
            item.watch(lock, state, job=job, cfg=cfg, send=send)

    def close(self) -> None:
        """The monitor is done: last values written, endpoints closed."""
        for item in self.items:
            try:
                item.close()
            except Exception:  # noqa: BLE001 - closing must not change the exit status
                pass
