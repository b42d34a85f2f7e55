"""Wire format shared by the agent, the recording and the monitor.

Newline-delimited JSON objects, each with ``"v"`` (protocol version) and ``"type"``.
Nothing here does I/O; nothing that crosses the socket is ever executed.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from typing import Any

VERSION = 1

#: Longest line accepted from a socket or a recording; longer ones are skipped.
MAX_LINE = 4 * 1024 * 1024

#: Agent -> monitor (and recording) message types.
AGENT_TYPES = frozenset({"hello", "steps", "sample", "profile", "model", "log", "event"})
# Monitor -> agent commands, and the one list of their names: perfmon.messages.commands.

#: How often an agent sends what it has (sooner when events pile up): how stale a monitor's view of a job's step
#: count may be.
PUBLISH_TICK_S = 1.0
#: How the agent's warning that its recording stopped (a full disk) begins: the recording then ends early, and
#: a monitor that followed the stream holds more than it.
RECORDING_STOPPED = "recording stopped:"

PHASES = ("data", "forward", "backward", "optimizer")
ALL_PHASES = (*PHASES, "other")
#: Each phase in a narrow column's heading.
PHASE_SHORT = {"data": "data", "forward": "fwd", "backward": "bwd", "optimizer": "opt", "other": "other"}
#: Kinds of time outside training steps, in a ``steps`` message's optional ``outside`` dict (``<kind>_ms``).
OUTSIDE_KINDS = ("evaluation", "checkpoint", "other")

#: Column order of a row in a ``steps`` message.
STEP_FIELDS = ("i", "t", "dur_ms", "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "other_ms", "samples")


class DecodeError(ValueError):
    """A line that is not a valid message."""


def _clean(obj: Any) -> Any:
    """Replace non-finite floats (not valid JSON) with None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def message(type_: str, **fields: Any) -> dict[str, Any]:
    """Build a message dict with version and type."""
    return {"v": VERSION, "type": type_, **fields}


def encode(msg: dict[str, Any]) -> bytes:
    """One message as one JSON line (UTF-8, newline-terminated)."""
    try:
        text = json.dumps(msg, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(_clean(msg), separators=(",", ":"), allow_nan=False)
    return text.encode() + b"\n"


def decode(line: bytes | str, allowed: Iterable[str] = AGENT_TYPES) -> dict[str, Any]:
    """Parse one line into a message, or raise :class:`DecodeError` saying why."""
    if len(line) > MAX_LINE:
        raise DecodeError(f"line of {len(line)} bytes is over the {MAX_LINE} byte limit")
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DecodeError(f"not JSON: {exc}") from None
    except RecursionError:  # "[[[[..." nested deeper than the parser goes
        raise DecodeError("JSON nested too deeply") from None
    if not isinstance(msg, dict):
        raise DecodeError("not a JSON object")
    v = msg.get("v")
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise DecodeError("missing protocol version")
    if v > VERSION:
        raise DecodeError(f"protocol version {v} is newer than this perfmon ({VERSION})")
    t = msg.get("type")
    if not isinstance(t, str) or t not in allowed:
        raise DecodeError(f"unknown message type {t!r}")
    return msg


def is_exit(msg: dict[str, Any]) -> bool:
    """The agent's last message: the ``exit`` event (read by whoever follows a stream, before any parsing)."""
    return msg.get("type") == "event" and msg.get("kind") == "exit"


def hello_pid(msg: dict[str, Any]) -> int | None:
    """The job's pid, when ``msg`` is a ``hello`` that carries one."""
    pid = msg.get("pid") if msg.get("type") == "hello" else None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def exception_line(text: str | None) -> str | None:
    """An exception as one line: ``SyntaxError: '(' was never closed (syn.py line 2)``.

    ``traceback.format_exception_only`` gives several lines for a SyntaxError (file, source line, caret,
    message); recordings written before this was normalised still carry that text.
    """
    if not text:
        return text
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) <= 1:
        return text.strip()
    m = re.match(r'\s*File "([^"]+)", line (\d+)', lines[0])
    if m:  # the message is the first line after the indented source and caret (3.11 notes follow it)
        message = next((line for line in lines[1:] if not line[:1].isspace()), lines[-1]).strip()
        return f"{message} ({os.path.basename(m[1])} line {m[2]})"
    tracebacks = [i for i, line in enumerate(lines) if i and "Traceback (most recent call last)" in line]
    if tracebacks:
        # an error re-raised from another process (a DataLoader worker, a multiprocessing pool) carries the
        # original traceback: the original error is its first line not indented (hints and notes may follow)
        after = [line for line in lines[tracebacks[-1] + 1:] if not line[:1].isspace()]
        if after:
            lines = after
    # A message of several lines (torch's often end in a URL or a hint; 3.11 notes follow it): its first line,
    # and the next where the first only introduces it ("See:", a message that starts on a new line).
    first = lines[0].strip()
    return f"{first} {lines[1].strip()}" if first.endswith(":") else first


def step_rows_to_dicts(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of a ``steps`` message as dicts keyed by its ``fields``; bad rows are dropped."""
    fields = msg.get("fields", STEP_FIELDS)
    rows = msg.get("rows")
    if not isinstance(fields, list | tuple) or not isinstance(rows, list):
        return []
    out = []
    for row in rows:
        if isinstance(row, list) and len(row) == len(fields):
            out.append(dict(zip(fields, row, strict=True)))
    return out
