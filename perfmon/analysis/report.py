"""Summaries of a run: the report JSON (schema 1), the headless status line and summary table.

Everything is computed from a :class:`~perfmon.analysis.state.RunState`, so a live run, a finished
recording and a partial one (a killed job) report the same way.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import psutil

from perfmon import paths
from perfmon.analysis.profile_window import summarised
from perfmon.analysis.state import RunState
from perfmon.messages import ProfileWindow, as_sent
from perfmon.protocol import ALL_PHASES, PHASE_SHORT
from perfmon.recording import RecordingReader, read_all

SCHEMA = 1


class ReportError(Exception):
    """A run dir that cannot be reported on; the message is for the user."""


def run_dir_of(path: Path) -> Path:
    """The run dir named by ``path``: the dir itself, or the dir of its ``events.jsonl``."""
    path = Path(path)
    return path.parent if path.name == "events.jsonl" and path.is_file() else path


def spawned_job_of(run_dir: Path) -> Path | None:
    """The job of the ranks the script recorded in ``run_dir`` spawned itself, where that is all it ran (a script
    that trained steps of its own is read as itself; its ranks as ``RUN/ranks``)."""
    from perfmon.analysis.job import spawned_ranks

    ranks = spawned_ranks(run_dir)
    if ranks is None:
        return None
    try:
        return ranks if not load_recording(run_dir).steps else None
    except ReportError:
        return ranks


def load_recording(run_dir: Path) -> RunState:
    """Replay ``run_dir/events.jsonl`` into a fresh state (``run_dir`` may name the recording file itself)."""
    run_dir = run_dir_of(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    events = run_dir / "events.jsonl"
    if not events.is_file():
        raise ReportError(f"{run_dir}: no recording (events.jsonl) in this directory")
    state = RunState()
    reader = RecordingReader(events)
    for msg in summarised(read_all(reader)):  # windows analysed from their traces
        state.apply(msg)
    state.skipped += reader.skipped
    if not state.meta.received:
        newer = [e for e in reader.errors if "newer" in e]
        if newer:
            raise ReportError(f"{run_dir}: {newer[0]}; upgrade perfmon to read it")
        raise ReportError(f"{run_dir}: events.jsonl holds no perfmon recording")
    return state


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


#: Said instead of an all-zero phase table when a run recorded no step.
NO_STEPS = ("no training steps seen: no DataLoader fetch, module call and optimizer step made a step "
            "(a custom loop? mark steps with perfmon.step(); README \"What is measured, and how\")")


#: Said where the job steps without a DataLoader: its data row reads 0, which is not what its batches cost.
NO_LOADER = "no DataLoader: the batches the script builds are in other"


#: Said instead where the job never imported torch: its training ran in processes perfmon did not start.
NO_TORCH = ("no training steps seen: this process never imported torch. Training that a launcher runs in processes "
            "of its own (a subprocess) is not followed: run the training script itself under perfmon (perfmon "
            "train.py; perfmon torchrun --nproc_per_node N train.py or perfmon accelerate launch train.py for the "
            "processes those launchers start)")


def no_steps(state: RunState) -> str:
    """Why a run has no step, as far as the recording tells: it ended first (failed, killed, a non-zero exit), it never
    imported torch, or its loop is one perfmon cannot see."""
    ended = state.exit
    if ended is not None and (ended.exception or ended.signal or ended.code not in (0, None)):
        return f"no training steps: the script ended ({state.status}) before its first step"
    return NO_TORCH if ended is not None and state.meta.cuda is None else NO_STEPS


def build_summary(state: RunState, findings: list[Any] | None = None) -> dict[str, Any]:
    """The stable report JSON; see README "Report JSON". ``findings`` default: the rules over the whole state."""
    if findings is None:
        from perfmon.analysis.rules import evaluate_once

        findings = evaluate_once(state)
    phases = state.phase_stats(recent=False)
    step = phases["step"]
    shares = {p: phases[p].share or 0.0 for p in ALL_PHASES}
    total_share = sum(shares.values())
    rounded = {p: round(shares[p] / total_share, 6) if total_share > 0 else 0.0 for p in ALL_PHASES}
    if total_share > 0:  # the rounding remainder goes to the largest share: the sum is exactly 1
        top = max(rounded, key=rounded.get)
        rounded[top] = round(1.0 - sum(v for p, v in rounded.items() if p != top), 6)
    exit_info = state.exit
    meta = state.meta
    flops = state.flops()
    return {
        "schema": SCHEMA,
        "script": meta.script,
        "argv": list(meta.argv),
        "exit_code": state.exit_status if exit_info is not None else None,
        "signal": exit_info.signal if exit_info else None,
        "exception": exit_info.exception if exit_info else None,
        "complete": exit_info is not None,
        "steps": state.steps,
        # without an exit, up to the recording's last word (a killed job's report does not grow with the clock)
        "elapsed_s": round(state.elapsed(None if state.exit else _last_word(state)), 3),
        "steps_per_s": _round(state.steps_per_s(recent=False)) or 0.0,
        "samples_per_s": _round(state.samples_per_s(recent=False), 2),
        "phases": {
            p: {
                "mean_ms": _round(phases[p].mean_ms) or 0.0,
                "p50_ms": _round(phases[p].p50_ms) or 0.0,
                "p95_ms": _round(phases[p].p95_ms) or 0.0,
                "share": rounded[p],
            }
            for p in ALL_PHASES
        },
        "step_ms": {"mean_ms": _round(step.mean_ms), "p50_ms": _round(step.p50_ms), "p95_ms": _round(step.p95_ms)},
        "outside_steps": _outside(state),
        "profiled_steps": state.windowed_steps,  # inside profiler/FLOP windows: left out of "phases" and "step_ms"
        # step 1, left out of "phases", "step_ms" and the rates (None: kept, in a short run)
        "first_step_ms": _round(first.dur) if (first := state.first_step_left_out()) is not None else None,
        "closures_per_step": _round(state.closures_per_step(), 3),
        "prefetch_share": _round(state.prefetch_share(), 4),  # other threads' fetches / step time (None: none)
        "run_dir": meta.run_dir,
        "pid": meta.pid,
        "start": meta.start,
        "device_timed": state.device_timed,
        "skipped_lines": state.skipped,
        "agent_errors": state.agent_errors,
        "device": _device(state),
        "host": _host(state),
        "model": _model(state),
        "profiles": [_profile(p) for p in state.profiles],
        "flops_per_step": flops.flops_per_step,
        "mfu": _round(flops.mfu, 4),
        "findings": [f.to_json() for f in findings],
    }


def outside_line(outside_steps: dict[str, Any]) -> str | None:
    """The summary's line of time outside steps (``outside_steps`` of a summary), or None where there is none."""
    # a kind under 0.05% of the time reads "0.0%": noise (a step cut short by a signal), left to the JSON
    kinds = [f"{kind} {v['share'] * 100:.1f}%" for kind, v in outside_steps.items() if v["ms"] and v["share"] >= 0.0005]
    return f"  {'outside':<10} {', '.join(kinds)} of wall time (not in any step)" if kinds else None


def _outside(state: RunState) -> dict[str, Any]:
    """Time outside training steps: ms and share of wall time per kind (evaluation, checkpoint, other)."""
    # without an exit, up to the recording's last word, as elapsed_s (the share shrank with the clock)
    shares = state.outside_shares(None if state.exit else _last_word(state)) or {}
    return {k: {"ms": _round(v) or 0.0, "share": _round(shares.get(k), 4) or 0.0} for k, v in state.outside_ms.items()}


def _device(state: RunState) -> dict[str, Any] | None:
    if not state.gpus:
        return None
    g, cm, peaks = state.gpus[0], state.cuda_mem, state.peaks
    return {
        "name": g.name, "count": len(state.gpus), "total_bytes": g.total_bytes,
        "peak_util": peaks.util_gpu,
        "peak_reserved_bytes": peaks.reserved_bytes,
        "peak_allocated_bytes": peaks.allocated_bytes,
        "peak_step_allocated_bytes": peaks.steady_allocated_bytes,
        "alloc_retries": cm.alloc_retries if cm else None, "ooms": cm.ooms if cm else None,
        "power_limit_w": g.power_limit_w, "throttled": list(g.throttled),
    }


def _host(state: RunState) -> dict[str, Any]:
    host = state.host
    return {
        "peak_rss_bytes": state.peaks.rss_bytes,
        "peak_workers_rss_bytes": state.peaks.workers_rss_bytes,
        "mean_cpu_percent": _round(state.mean_cpu_percent, 2),
        "peak_cpu_percent": state.peaks.cpu_percent,
        "cpu_count": host.cpu_count if host else None,
        "usable_cpus": host.usable_cpus if host else None,
        "cpu_limit": host.cpu_limit if host else None,
        "torch_threads": host.torch_threads if host else None,
        "mem_total_bytes": host.mem_total_bytes if host else None,
        "samples": state.samples_seen,
        "sampler_cpu_fraction": _round(state.sampler_cpu_s / (state.samples_seen * state.sample_interval), 6)
        if state.samples_seen else None,
    }


def _model(state: RunState) -> dict[str, Any] | None:
    if state.model is None:
        return None
    m = state.model
    budget = state.memory_budget()
    return {
        "params": m.params, "trainable": m.trainable, "frozen": m.frozen,
        "by_dtype": dict(m.by_dtype) if m.by_dtype is not None else None, "param_bytes": m.param_bytes,
        "optimizer_bytes": m.optimizer_bytes, "static_bytes": m.static_bytes,
        "per_sample_bytes": budget.per_sample_bytes, "max_batch": budget.max_batch,
        "peak_source": budget.peak_source, "memory_note": budget.reason,
    }


def _fmt_ms(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _fmt_rate(x: float | None, unit: str) -> str:
    return "—" if x is None else f"{x:,.1f} {unit}"


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def status_line(state: RunState, now: float | None = None) -> str:
    """One line for headless logs (every ``--interval`` seconds)."""
    stats = state.phase_stats(recent=True)
    now = time.time() if now is None else now
    quiet = state.quiet_for(now)
    stalled = f" | no step for {format_duration(quiet)}" if quiet is not None else ""
    shares = " ".join(
        f"{PHASE_SHORT[p]} {(stats[p].share or 0.0) * 100:.0f}%" for p in ALL_PHASES if stats[p].share is not None
    )
    return (
        f"[perfmon] {format_duration(state.elapsed())} step {state.steps} | "
        f"{_fmt_rate(state.steps_per_s(), 'steps/s')} | {_fmt_rate(state.samples_per_s(), 'samples/s')} | "
        f"step {_fmt_ms(stats['step'].mean_ms)} ms | {shares or 'waiting for the first step'}{stalled}"
    )


def _last_word(state: RunState) -> float | None:
    """The time of the newest step or sample: where a recording without an exit ends."""
    times = [t for t in (state.last_end, state.last_sample_t) if t is not None]
    return max(times) if times else state.meta.start


def _no_exit(state: RunState) -> str:
    """The status of a recording without an exit: its process still runs here, or it was killed."""
    meta = state.meta
    if state.execed is not None:  # the pid lives on as the new program: no agent of perfmon's is in it
        return f"{state.status}: perfmon did not follow it, and its exit is not recorded"
    if meta.pid and meta.start and meta.host == socket.gethostname() and paths.pid_alive(meta.pid):
        try:  # the same process, not a later one given its pid: it began before its recording did
            began = psutil.Process(meta.pid).create_time()
        except (psutil.Error, OSError):
            began = None
        if began is not None and began <= meta.start + 1.0:
            return f"running (pid {meta.pid}): no exit yet; perfmon attach {meta.pid} follows it live"
    return "no exit recorded (killed, or running on another machine)"


def _si(value: float) -> str:
    """``523.8 M``, ``12.3 T``: a FLOP count or rate with its SI prefix and a space before the unit."""
    for size, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.4g} {prefix}"
    return f"{value:.0f} "


def format_summary(state: RunState, summary: dict[str, Any] | None = None) -> str:
    """The human summary: header, phase table, exit status (``summary``: already built, e.g. with --rules)."""
    s = summary if summary is not None else build_summary(state)
    argv = " ".join(s["argv"]) or s["script"] or "?"
    exit_text = state.status if state.exit else _no_exit(state)
    lines = [
        f"perfmon summary: {argv}",
        f"  run dir   {s['run_dir']}",
        f"  status    {exit_text}",
        f"  steps     {s['steps']} in {format_duration(s['elapsed_s'])}"
        f"  ({s['steps_per_s']:.2f} steps/s"
        + (f", {s['samples_per_s']:,.1f} samples/s" if s["samples_per_s"] else "")
        + (" from step 2)" if s.get("first_step_ms") is not None else ")"),
    ]
    if s["steps"] == 0:
        lines += ["", f"  {no_steps(state)}"]
    else:
        lines += ["", f"  {'phase':<10} {'mean ms':>10} {'p50 ms':>10} {'p95 ms':>10} {'share':>7}"]
    for p in ALL_PHASES if s["steps"] else ():
        ph = s["phases"][p]
        lines.append(
            f"  {p:<10} {_fmt_ms(ph['mean_ms']):>10} {_fmt_ms(ph['p50_ms']):>10} "
            f"{_fmt_ms(ph['p95_ms']):>10} {ph['share'] * 100:>6.1f}%"
        )
    st = s["step_ms"]
    if s["steps"]:
        lines.append(f"  {'step':<10} {_fmt_ms(st.get('mean_ms')):>10} {_fmt_ms(st.get('p50_ms')):>10} "
                     f"{_fmt_ms(st.get('p95_ms')):>10}")
    if s["profiled_steps"]:
        lines.append(f"  {'':<10} ({s['profiled_steps']} profiled steps left out: the profiler slows them down)")
    if s.get("first_step_ms") is not None:
        lines.append(f"  {'first':<10} {_fmt_ms(s['first_step_ms']):>10} ms, left out of the table and the rates "
                     "(warm-up: first calls, compilation, setup before the loop)")
    outside = outside_line(s["outside_steps"])
    if outside:
        lines.append(outside)
    if s["closures_per_step"]:
        lines.append(f"  {'closures':<10} {s['closures_per_step']:.1f} evaluations per step (optimizer.step(closure))")
    if state.no_loader():
        lines.append(f"  {'data':<10} {NO_LOADER}")
    if s.get("prefetch_share"):
        lines.append(f"  {'prefetch':<10} another thread fetched batches for {s['prefetch_share'] * 100:.0f}% of the "
                     "step time (a prefetching thread: the training thread's wait for it is in other)")
    flops = state.flops()
    if flops.flops_per_step:
        line = f"  {'flops':<10} {_si(flops.flops_per_step)}FLOP a step"
        if flops.achieved_flops:
            line += f" · {_si(flops.achieved_flops)}FLOP/s achieved"
        if flops.mfu is not None and flops.peak_tflops:
            line += (f" · MFU {flops.mfu * 100:.1f}% of {_si(flops.peak_tflops * 1e12)}FLOP/s"
                     + (f" ({flops.peak_source})" if flops.peak_source else ""))
        elif flops.reason:
            line += f" · MFU n/a: {flops.reason}"
        lines.append(line)
    if state.exit and state.exit.exception:
        lines += ["", f"  exception {state.exit.exception}"]
    if s["findings"]:
        lines += ["", "  findings"]
        for f in s["findings"]:
            lines.append(format_saved_finding(f))
    else:
        lines += ["", f"  findings  none: {_no_findings(state)}"]
    if s["skipped_lines"]:
        lines.append(f"  note: {s['skipped_lines']} malformed recording lines were skipped")
    if s["agent_errors"]:
        lines.append(f"  note: agent internal errors {s['agent_errors']} (training was not affected)")
    return "\n".join(lines)


def _no_findings(state: RunState) -> str:
    """Why a summary lists no finding: nothing held, or too few steps for the rules that judge steps."""
    from perfmon.analysis.rules.base import Config, judged_steps

    cfg = Config()
    judged = len(judged_steps(state, cfg))
    if judged >= cfg.min_steps:
        return "nothing the rules can name held this run back"
    if not state.steps:
        return "the run ended before its first step"
    return (f"too few steps past warm-up for the rules that judge steps ({judged} of the {cfg.min_steps} they "
            "need)")


def format_finding(severity: str, rule_id: str, title: str, fix: str) -> str:
    """A finding in two indented lines: severity and title, then the fix."""
    return f"  [{severity}] {rule_id}: {title}\n      fix: {fix}"


def format_saved_finding(f: dict[str, Any]) -> str:
    """:func:`format_finding` of a finding as the report JSON (summary.json) holds it."""
    return format_finding(f["severity"], f["id"], f["title"], f["fix"])


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """RUN/summary.json, written whole (a temporary file, then a rename); a full disk leaves the old one."""
    path = Path(run_dir) / "summary.json"
    tmp = path.with_name(f".summary.json.{os.getpid()}.tmp")  # several writers (a job's ranks) never share one
    try:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def report_main(run_dir: Path, as_json: bool, rules: Any = None, write: bool = False, wait: float = 0.0) -> int:
    """``perfmon report RUN [--json] [--rules FILE] [--write-summary]``; a job's run dir reports every rank."""
    from perfmon.analysis.job import is_job_dir

    if not write and (ranks := spawned_job_of(run_dir_of(run_dir))) is not None:
        run_dir = ranks  # a script that spawned its ranks: their job is what it ran
    if is_job_dir(run_dir_of(run_dir)):
        from perfmon.analysis.job_report import job_report_main

        return job_report_main(run_dir_of(run_dir), as_json, rules, write, wait)
    state = load_recording(run_dir)
    findings = None
    if rules is not None:
        from perfmon.analysis.rules import evaluate_once

        findings = evaluate_once(state, rules)
    summary = build_summary(state, findings)
    if write:
        write_summary(run_dir_of(run_dir), summary)
    elif as_json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(state, summary))
    return 0


def _profile(p: ProfileWindow) -> dict[str, Any]:
    """A profiler window in the report: the keys every version wrote, and what the trace analysis adds
    (windows analysed outside the job: kernels, HTA breakdown, the trace's findings)."""
    out: dict[str, Any] = {
        "step": p.step,
        "top_ops": [{"name": op.name, "calls": op.calls, "self_ms": op.self_ms, "total_ms": op.total_ms,
                     "share": op.share, "flops": op.flops} for op in p.top_ops],
        "syncs_per_step": p.syncs_per_step, "device_busy": p.device_busy, "trace": p.trace,
    }
    sent = as_sent(p)
    for key in ("top_kernels", "breakdown", "trace_findings", "analysis_error"):
        if key in p.given:
            out[key] = sent[key]
    return out
