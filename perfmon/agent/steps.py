"""Step detection: turns the hot path's raw hook events into step records.

Pure Python, no torch: the hooks append ``(code, t, arg)`` tuples and this state machine,
run on the agent's daemon thread, decides where steps begin and end. Rules:

* Only the outermost phase counts; phases nested inside it (LBFGS runs forward and
  backward inside ``optimizer.step``; checkpointing re-runs forward inside backward)
  are part of the outer phase, never counted twice.
* A step ends when an outermost optimizer phase ends. Where no optimizer exists
  (manual parameter updates), a step ends when data or a forward begins after a backward.
* Once the script calls ``perfmon.step()``, only explicit calls end steps.
* Evaluation: two forwards under ``no_grad`` in a row (no backward between) mean the loop
  is evaluating; the partial step is discarded so eval time does not inflate a step.
  A single no-grad forward (a frozen teacher, a target network) stays part of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Event codes (small ints keep the hot path cheap).
BEGIN = 0  # arg: phase name
END = 1  # arg: phase name, or ("data", samples) for data ends
STEP = 2  # explicit perfmon.step()
OPTIMIZER_CREATED = 3
NOGRAD_FORWARD = 4  # a root forward began with grad disabled

PHASES = ("data", "forward", "backward", "optimizer")


@dataclass
class StepRecord:
    """One training step, times in seconds (host clock)."""

    index: int
    start: float
    end: float
    phases: dict[str, float]
    samples: int | None
    marks: dict[str, list[tuple[Any, Any]]] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def other(self) -> float:
        return max(0.0, self.duration - sum(self.phases.values()))


class StepTracker:
    """Feed events in order with :meth:`feed`; completed steps come back as a list."""

    def __init__(self) -> None:
        self.count = 0
        self.explicit = False
        self.has_optimizer = False
        self._depth = 0
        self._phase: str | None = None
        self._phase_start = 0.0
        self._phase_mark: Any = None
        self._nograd_streak = 0
        self._pending_nograd = False
        self._last_t = 0.0
        self._reset_partial()

    def _reset_partial(self) -> None:
        self._start: float | None = None
        self._acc = dict.fromkeys(PHASES, 0.0)
        self._samples = 0
        self._after_backward = False
        self._marks: dict[str, list[tuple[Any, Any]]] = {}
        self._start_mark: Any = None

    def finish(self) -> StepRecord | None:
        """The job ended: a manual-update step whose backward was its last phase is complete."""
        if self._depth == 0 and self._auto_close_on_next():
            return self._close(self._last_t, None)
        return None

    def feed(self, code: int, t: float, arg: Any = None, mark: Any = None) -> StepRecord | None:
        """Apply one event; return the step it completed, if any."""
        self._last_t = t
        if code == BEGIN:
            return self._begin(arg, t, mark)
        if code == END:
            return self._end(arg, t, mark)
        if code == STEP:
            first = not self.explicit
            self.explicit = True
            if first and self.count and not any(self._acc.values()):
                return None  # an automatic boundary already closed this step just now
            if self._start is None:  # step() with no phase before it: this call starts the clock
                self._start, self._start_mark = t, mark
                return None
            return self._close(t, mark)
        if code == OPTIMIZER_CREATED:
            self.has_optimizer = True
        elif code == NOGRAD_FORWARD:
            self._pending_nograd = True
        return None

    def _begin(self, phase: str, t: float, mark: Any) -> StepRecord | None:
        done = None
        nograd, self._pending_nograd = self._pending_nograd, False
        if self._depth == 0:
            if phase in ("data", "forward") and self._auto_close_on_next():
                done = self._close(t, mark)
            if phase == "forward":
                self._nograd_streak = self._nograd_streak + 1 if nograd else 0
            if phase == "forward" and self._nograd_streak >= 2 and not self.explicit:
                # Evaluating: drop the partial step and ignore this forward entirely.
                self._reset_partial()
                self._phase = None
                self._depth += 1
                return done
            if self._start is None:
                self._start = t
                self._start_mark = mark
            self._phase = phase
            self._phase_start = t
            self._phase_mark = mark
        self._depth += 1
        return done

    def _auto_close_on_next(self) -> bool:
        return self._after_backward and not self.has_optimizer and not self.explicit

    def _end(self, arg: Any, t: float, mark: Any) -> StepRecord | None:
        if self._depth == 0:
            return None  # unbalanced end (an exception skipped a begin): ignore
        self._depth -= 1
        if self._depth or self._phase is None:
            return None
        samples = arg[1] if isinstance(arg, tuple) else None
        phase = self._phase  # the outermost phase owns the time, whatever ended
        self._phase = None
        if self._start is None:  # partial step was discarded (evaluation) mid-phase
            return None
        self._acc[phase] += t - self._phase_start
        if mark is not None and self._phase_mark is not None:
            self._marks.setdefault(phase, []).append((self._phase_mark, mark))
        if phase == "data" and samples:
            self._samples += samples
        elif phase == "backward":
            self._after_backward = True
            self._nograd_streak = 0
        elif phase == "optimizer" and not self.explicit:
            self.has_optimizer = True
            return self._close(t, mark)
        return None

    def _close(self, t: float, mark: Any) -> StepRecord | None:
        if self._start is None:
            return None
        self.count += 1
        marks = dict(self._marks)
        if mark is not None and self._start_mark is not None:
            marks["step"] = [(self._start_mark, mark)]
        rec = StepRecord(self.count, self._start, t, dict(self._acc), self._samples or None, marks)
        self._reset_partial()
        # The next step starts where this one ended: time between steps is "other".
        self._start = t
        self._start_mark = mark
        return rec
