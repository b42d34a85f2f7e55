"""Read a PyTorch profiler (Kineto) trace file into frozen events: stdlib only, one pass over the JSON.

Times are microseconds as in the file. Only what the analysis needs is kept: CPU ops, user annotations,
ProfilerStep annotations, CUDA runtime/driver calls (they carry the correlation id of what they launched)
and device events (kernels, memcpy, memset) on a stream.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_STEP_RE = re.compile(r"^ProfilerStep\s*#\s*\d+")


class TraceError(Exception):
    """The path is missing, unreadable, or not a Kineto trace."""


@dataclass(frozen=True, slots=True, eq=False)  # identity: two events can carry the same fields
class HostEvent:
    """A span on a CPU thread; `correlation` links a runtime call to what it launched (-1: none)."""

    name: str
    start: float
    end: float
    thread: tuple[Any, Any]
    correlation: int = -1


@dataclass(frozen=True, slots=True, eq=False)
class DeviceEvent:
    """A kernel, memcpy or memset on a device stream."""

    name: str
    start: float
    end: float
    stream: int
    correlation: int


@dataclass(frozen=True)
class TraceEvents:
    """One rank's trace, parsed."""

    file: str
    rank: int | None
    world_size: int | None
    device: str
    ops: tuple[HostEvent, ...]
    annotations: tuple[HostEvent, ...]
    steps: tuple[HostEvent, ...]
    runtime: tuple[HostEvent, ...]
    kernels: tuple[DeviceEvent, ...]


def trace_files(path: Path) -> list[Path]:
    """The trace file itself, or every `*.json` / `*.json.gz` file in a folder (sorted by name)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith((".json", ".json.gz")))
        if not files:
            raise TraceError(f"{path}: no *.json or *.json.gz trace files in this folder")
        return files
    if not path.exists():
        raise TraceError(f"{path}: no such file or folder")
    return [path]


def _read_json(path: Path) -> Any:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
        return json.loads(raw)
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError, ValueError) as e:
        raise TraceError(f"{path}: cannot read a JSON trace ({type(e).__name__}: {e})") from None


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _device_name(meta: dict[str, Any], devices: Counter[int]) -> str:
    """Name of the GPU the kernels ran on (a trace lists every visible GPU); "cpu" when there is none."""
    props = [p for p in meta.get("deviceProperties") or [] if isinstance(p, dict)]
    if not devices or not props:
        return "cpu" if not devices else "gpu"
    used = devices.most_common(1)[0][0]
    for p in props:
        if _int(p.get("id"), -1) == used:
            return str(p.get("name", "gpu"))
    return str(props[0].get("name", "gpu"))


def load_trace(path: Path) -> TraceEvents:
    """Parse one trace file (`.json` or `.json.gz`)."""
    doc = _read_json(path)
    meta: dict[str, Any] = doc if isinstance(doc, dict) else {}
    events = meta.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise TraceError(f"{path}: not a PyTorch profiler trace (no traceEvents list)")
    ops: list[HostEvent] = []
    annotations: list[HostEvent] = []
    steps: list[HostEvent] = []
    runtime: list[HostEvent] = []
    kernels: list[DeviceEvent] = []
    devices: Counter[int] = Counter()
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat, ts, dur = e.get("cat"), e.get("ts"), e.get("dur")
        timed = isinstance(ts, (int, float)) and isinstance(dur, (int, float))
        if cat is None or cat == "Trace" or not timed:
            continue
        start, end = float(ts), float(ts + dur)
        name = str(e.get("name", ""))
        args = e.get("args")
        args = args if isinstance(args, dict) else {}
        correlation = _int(args.get("correlation", -1), -1)
        stream = _int(args.get("stream", -1), -1)
        if stream >= 0 and correlation >= 0 and cat != "gpu_user_annotation":
            # HTA's definition of a GPU kernel: an event on a stream with a correlation id.
            kernels.append(DeviceEvent(name, start, end, stream, correlation))
            devices[_int(args.get("device", e.get("pid")), -1)] += 1
            continue
        thread = (e.get("pid"), e.get("tid"))
        if _STEP_RE.match(name):
            steps.append(HostEvent(name, start, end, thread))
        elif cat == "cpu_op":
            ops.append(HostEvent(name, start, end, thread))
        elif cat == "user_annotation":
            annotations.append(HostEvent(name, start, end, thread))
        elif correlation >= 0:
            runtime.append(HostEvent(name, start, end, thread, correlation))
    if not (ops or kernels or steps or annotations):
        raise TraceError(f"{path}: not a PyTorch profiler trace (no CPU ops or GPU kernels in it)")
    dist = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}
    rank = dist.get("rank")
    world = dist.get("world_size")
    return TraceEvents(
        file=path.name,
        rank=rank if isinstance(rank, int) else None,
        world_size=world if isinstance(world, int) else None,
        device=_device_name(meta, devices),
        ops=tuple(ops),
        annotations=tuple(annotations),
        steps=tuple(sorted(steps, key=lambda s: s.start)),
        runtime=tuple(runtime),
        kernels=tuple(kernels),
    )
