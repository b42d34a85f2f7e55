"""The agent's answers to the command keys, shown as toasts, and its warnings."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from textual.app import App

from perfmon.analysis.job import warning_line
from perfmon.messages import CommandResult


class ResultFeed:
    """Picks the command results not yet shown out of the state's (bounded) list of them."""

    def __init__(self) -> None:
        self._last: CommandResult | None = None  # the newest result shown: by identity, as results repeat
        self._said: set[str] = set()  # background commands' failures already shown

    def new(self, command_results: Iterable[CommandResult]) -> list[CommandResult]:
        """Results that came in since the last call (call with the state lock held)."""
        results = list(command_results)
        new = results
        if self._last is not None:
            for i in range(len(results) - 1, -1, -1):
                if results[i] is self._last:
                    new = results[i + 1:]
                    break
        if results:
            self._last = results[-1]
        return [r for r in new if self._shown(r)]

    def _shown(self, result: CommandResult) -> bool:
        """The --wandb logger's ``log_metrics`` runs every few seconds without a key: only a failure, once."""
        if result.name != "log_metrics":
            return True
        if result.ok is not False or (result.message or "") in self._said:
            return False
        self._said.add(result.message or "")
        return True


#: A command result's toast title, in the words of the key's help (the wire names are ids).
TITLES = {"profile": "profiler window", "empty_cache": "free CUDA cache", "count_flops": "FLOP count",
          "memory_snapshot": "memory snapshot", "export": "export of top ops", "stop": "stop",
          "log_metrics": "metrics logging"}


def toast(app: App[Any], result: CommandResult) -> None:
    """One command result as a toast; an error when the command failed.

    A profiler window's progress is drawn by the ops view itself (capture marker, then the table):
    its acknowledgement is not toasted, and its result only briefly, so no toast sits on the table.
    """
    name = result.name or "command"
    text = result.message or result.error or f"{name}: done"
    ok = result.ok is not False
    if name == "profile" and ok and result.done is False:
        return
    timeout = 2.5 if name == "profile" and ok else 5.0 if result.done is False else 8.0
    # the agent's words are text, not markup: "[Errno 28] No space left" must read as it came
    app.notify(text, title=TITLES.get(name, name), severity="information" if ok else "error", timeout=timeout,
               markup=False)


#: A recording replayed or attached late may hold many warnings: the newest few are toasted, all are in the log.
WARNING_TOASTS = 3


def say_warnings(app: App[Any], warnings: list[tuple[str, str]], log: Any) -> None:
    """The agent's new warnings (``WarningFeed.new``): each a line of the output panel (where they stay), the
    newest few a toast."""
    if not warnings:
        return
    log.add_lines([warning_line(who, text) for who, text in warnings])
    for who, text in warnings[-WARNING_TOASTS:]:
        app.notify(text, title=f"perfmon warning{f' ({who})' if who else ''}", severity="warning", timeout=15,
                   markup=False)
