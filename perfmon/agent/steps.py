"""Step detection: where steps begin and end, and what each one spent its time on.

Pure Python, no torch. Two halves:

* :class:`Boundaries` runs on the training thread inside the hooks. It decides, at the
  moment a phase begins, whether the previous step is over (a *commit*), so that
  commands (profiler windows, FLOP counts) start and stop on whole loop iterations.
* :class:`StepTracker` runs on the agent's thread over the recorded events. It measures
  each step: self time per phase, samples, closure evaluations, and the time spent
  outside training steps (evaluation, checkpoints).

Rules (README "What is measured, and how" says the same):

* A step is one iteration of the training loop. It ends at its last optimizer step
  (``optimizer.step`` or ``GradScaler.step``, skipped or not); the end is confirmed when
  the next iteration begins: a DataLoader fetch, an optimizer that already stepped in
  this step, or a forward once every optimizer of the loop has stepped. So a GAN's
  discriminator and generator steps are one step, gradient accumulation is one step.
* Without any optimizer (manual updates), a step ends at the backward followed by the
  next data fetch or forward. Once the script calls ``perfmon.step()``, only its calls
  end steps.
* Nested phases are charged to the innermost (self time): LBFGS's forward and backward
  inside ``step(closure)`` are forward and backward; "optimizer" is its own work, and the
  closure's own work (the loss, ``zero_grad``, a framework's hooks) is "other", as in a plain loop.
* Between steps, a stretch with evaluation forwards (a no-grad call of a trained model or
  of a copy of it), extra DataLoader fetches or ``torch.save`` is time outside training
  steps, never part of a step. A no-grad forward of a module that is never trained (a
  frozen teacher) stays in the step. So between two micro-batches of one step (gradient accumulation
  with validation every N batches): that stretch is outside time, and the step's time leaves it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from perfmon.agent.native import HOT, HotState
from perfmon.protocol import OUTSIDE_KINDS, PHASES

# Event codes (small ints keep the hot path cheap).
BEGIN = 0  # arg: phase name, or ("forward", module key, kind) from the forward hooks
END = 1  # arg: phase name, ("data", samples) or ("optimizer", optimizer key)
STEP = 2  # explicit perfmon.step()
OPTIMIZER_CREATED = 3  # an optimizer exists: a backward does not end a step (gradient accumulation)
PREFETCH = 4  # a DataLoader fetch on another thread (a prefetching generator) ended: arg (its seconds, samples)
BOUNDARY = 5  # the hooks committed a step boundary (Boundaries said so)
END_BOUNDARY = 6  # END, then BOUNDARY: a phase ended and with it the step (one event, not two)
#: One steady iteration of the C hooks, folded by the C event ring's drain: arg (t_fetch, t_fetched, samples,
#: t_forward, model key, t_forwarded, t_backward, t_backwarded, t_optimizer, optimizer key), the event's own time
#: the optimizer's end; t_fetch and t_fetched are None in a loop without a DataLoader. :func:`expand_steady`.
STEADY = 7

#: The marks of a part or step without CUDA events (read-only, shared: no allocation per step).
NO_MARKS: Mapping[str, list[tuple[Any, Any]]] = MappingProxyType({})

#: The fast path's STEADY steps in C (``_hot.SteadyStep``s, which read as StepRecords), where built.
_steady_steps = HOT.steady_steps if HOT is not None else None

#: Forward kinds in a ("forward", key, kind) BEGIN arg. EVALGRAD: with grad, the module in eval mode
#: (``model.eval()`` without ``torch.no_grad()``): an evaluation, unless a backward follows it.
GRAD, NOGRAD, COPY, EVALGRAD = 0, 1, 2, 3
#: ``iter(loader)``'s BEGIN and END args: a loader's epoch begins (its workers start), no batch is fetched; for
#: training (grad enabled, the model in train mode) or not (an evaluation's loader, as a rule)
NEW_EPOCH, NEW_EVAL_EPOCH = "new epoch", "new evaluation epoch"
NEW_EPOCH_BEGINS = ("data", NEW_EPOCH, NOGRAD)
NEW_EVAL_EPOCH_BEGINS = ("data", NEW_EVAL_EPOCH, NOGRAD)
NEW_EPOCH_ENDS = ("data", None)


def expand_steady(event: tuple[int, float, Any, Any]) -> list[tuple[int, float, Any, Any]]:
    """The events a STEADY event stands for, exactly as the hooks appended them."""
    _, t7, (t0, t1, n, t2, key, t3, t4, t5, t6, opt), _ = event
    steady = [(BEGIN, t2, ("forward", key, GRAD), None), (END, t3, "forward", None), (BEGIN, t4, "backward", None),
              (END, t5, "backward", None), (BEGIN, t6, "optimizer", None), (END_BOUNDARY, t7, ("optimizer", opt), None)]
    if t0 is None:
        return steady
    return [(BEGIN, t0, "data", None), (END, t1, ("data", n), None), *steady]

CHECKPOINT = "checkpoint"  # torch.save: not a step phase; marks time outside steps
#: The closure of ``optimizer.step(closure)`` runs: not a step phase (its own work is "other"), one evaluation.
CLOSURE = "closure"
OUTSIDE = OUTSIDE_KINDS  # evaluation, checkpoint, other


#: Steps an optimizer that was built and never stepped is waited for (a WGAN's generator steps every 5 critic
#: batches, as a rule; a discriminator switched on after a warm-up, a frozen part unfrozen later). One built and
#: never used costs the loop its fast path for these steps only; one that first steps later still splits that
#: iteration in two steps.
UNSTEPPED_PATIENCE = 100


class Boundaries(HotState):
    """The training thread's view of step boundaries. ``begin``/``end`` mirror the hooks.

    ``begin`` returns True when the previous step is over, before the phase starts. The fields the hooks read at
    every phase (``depth``, ``pending``, ``single``, ...) are its base's: C struct members where the C hot path
    was built (``native.HotState``).
    """

    __slots__ = ("stepped", "cycle", "loader_loop", "keys", "unstepped", "waited", "fetch_led", "fetch_led_before")

    # optimizers_seen: an optimizer exists or has stepped; until then a backward ends a step

    # From the base, all zero, False or None at start: depth; pending (a step's optimizer, or manual backward,
    # ended: the next iteration ends it); explicit; single (the loop's one optimizer, once learned: its step ends
    # the step, the fast path).

    def __init__(self) -> None:
        super().__init__()
        self.stepped: set[Any] = set()  # optimizers that stepped since the last boundary
        self.cycle: frozenset[Any] | None = None  # the optimizers one iteration steps, once learned
        self.loader_loop = False  # iterations begin with a DataLoader fetch
        self.keys: set[Any] = set()  # every optimizer that stepped and still exists (the hooks drop dead ones)
        #: optimizers built (and alive) that never stepped: one may step later in an iteration (a WGAN's generator,
        #: every n critic batches), so no update ends a step at once, and no forward after an update begins the
        #: next, while one is left; for UNSTEPPED_PATIENCE steps at most (an optimizer built and never used)
        self.unstepped: set[Any] = set()
        self.waited = 0  # steps ended while an optimizer was unstepped
        #: this step began at a DataLoader fetch (the fetch ended the last one), and so did the one before it (not
        #: known of the first step: its fetch never asks Boundaries, nothing was pending)
        self.fetch_led = False
        self.fetch_led_before = False

    def begin(self, phase: str, key: Any = None) -> bool:
        """``key``: the optimizer for an optimizer phase, the forward kind (GRAD, NOGRAD, COPY) for a forward."""
        commit = False
        if self.depth == 0 and self.pending and not self.explicit:
            if phase == "data" or phase == CHECKPOINT:
                commit = True
                self.loader_loop = self.loader_loop or phase == "data"
            elif phase == "forward":
                if not self.optimizers_seen or key not in (GRAD, EVALGRAD, None):
                    commit = True  # manual updates, or a no-grad forward after the step: evaluation
                else:  # a loop that fetches from a DataLoader begins its iterations there
                    commit = (not self.loader_loop and self.cycle is not None and self.stepped >= self.cycle
                              and not self.unstepped)
            elif phase == "optimizer":
                # an optimizer's second update begins the next iteration, except where this iteration and the one
                # before began with a fetch: then the next fetch begins it, and a second update per batch is the
                # loop's own (a GAN's lazy regularization: StyleGAN's extra D and G updates every n batches)
                commit = key in self.stepped and not (self.fetch_led and self.fetch_led_before)
            if commit:
                if self.cycle is None and self.optimizers_seen:
                    self.cycle = frozenset(self.stepped)
                self.stepped = set()
                self.pending = False
                self.fetch_led_before, self.fetch_led = self.fetch_led, phase == "data"
                if self.unstepped:
                    self.waited += 1
                    if self.waited > UNSTEPPED_PATIENCE:  # never used: the loop is the others'
                        self.unstepped.clear()
        self.depth += 1
        return commit

    def first_update(self, key: Any) -> None:
        """An optimizer built and waited for stepped for the first time (at any depth)."""
        self.unstepped.discard(key)
        if self.cycle is not None and key not in self.cycle:
            self.cycle = None  # the loop is learned again, with it: its forward after another's update is in

    def optimizer_made(self) -> bool:
        """An optimizer was built between phases. A loop that builds one per iteration (or per epoch, or per
        stage of unfreezing) begins its iteration there, and its optimizers are not the ones the loop was learned
        with: the step waiting to end is over, and the loop's shape is learned again. Returns True when a step was
        waiting (it is committed)."""
        if self.depth or self.explicit:
            return False  # inside a phase (built lazily in a forward, say), or the script marks its own steps
        self.cycle = None
        self.single = None
        if not self.pending:
            return False
        self.stepped = set()
        self.pending = False
        self.fetch_led_before, self.fetch_led = self.fetch_led, False
        return True

    def end(self, phase: str, key: Any = None) -> bool:
        """Returns True when the step is certainly over already (a loop with a single optimizer)."""
        if key is not None and key == self.single and self.depth == 1 and phase == "optimizer" and not self.explicit:
            self.depth = 0
            return True  # what the general case below decides for it, without the set arithmetic
        if self.depth:
            self.depth -= 1
        if phase == "optimizer" and key in self.unstepped:
            self.first_update(key)
        if self.depth == 0:
            if phase == "optimizer":
                self.optimizers_seen = True
                self.stepped.add(key)
                self.pending = True
                self.keys.add(key)
                # One optimizer, one update per iteration: the step ends now, so a loop that stalls (or
                # is killed) after its update has it recorded. Several optimizers, or another one built that
                # has not stepped yet, wait for the next iteration.
                if (not self.explicit and self.cycle is not None and len(self.keys) == 1 and not self.unstepped
                        and self.stepped >= self.cycle):
                    self.stepped = set()
                    self.pending = False
                    self.single = key if self.cycle == {key} else None
                    return True
                self.single = None
            elif phase == "backward" and not self.optimizers_seen:
                self.pending = True
        return False


@dataclass(slots=True)
class StepRecord:
    """One training step, times in seconds (host clock)."""

    index: int
    start: float
    end: float
    phases: dict[str, float]
    samples: int | None
    marks: Mapping[str, list[tuple[Any, Any]]] = field(default_factory=dict)
    closures: int = 0  # closure evaluations of optimizer.step(closure) (LBFGS, Lightning)
    prefetch: float = 0.0  # seconds other threads spent in DataLoader fetches that ended during the step

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def other(self) -> float:
        return max(0.0, self.duration - sum(self.phases.values()))


class _Part:
    """A step being built."""

    __slots__ = ("start", "start_mark", "end", "end_mark", "acc", "samples", "closures", "marks")

    def __init__(self, start: float, mark: Any) -> None:
        self.start = start
        self.start_mark = mark
        self.end = start
        self.end_mark: Any = None
        self.acc = dict.fromkeys(PHASES, 0.0)
        self.samples = 0
        self.closures = 0
        self.marks: Mapping[str, list[tuple[Any, Any]]] = NO_MARKS  # a dict once a CUDA mark arrives

    def mark_list(self, phase: str) -> list[tuple[Any, Any]]:
        """The CUDA event pairs of ``phase`` (host-only runs never allocate any)."""
        marks = self.marks
        if marks is NO_MARKS:
            marks = self.marks = {}
        return marks.setdefault(phase, [])  # type: ignore[union-attr]

    def absorb(self, other: _Part) -> None:
        for k, v in other.acc.items():
            self.acc[k] += v
        self.samples += other.samples
        self.closures += other.closures
        for k, pairs in other.marks.items():
            self.mark_list(k).extend(pairs)
        self.end, self.end_mark = other.end, other.end_mark


class _Segment:
    """A top-level data fetch, forward or checkpoint seen before this step's training work began."""

    __slots__ = ("kind", "key", "copy", "evalgrad", "paired", "begin", "end", "samples", "mark", "end_mark",
                 "exhausted", "opens", "trains")

    def __init__(self, kind: str, key: Any, forward_kind: int, begin: float, mark: Any, paired: bool = False) -> None:
        self.kind = kind
        self.paired = paired  # a module in train mode called after one in eval mode: read as the evaluation's
        self.key = key
        self.copy = forward_kind == COPY
        self.evalgrad = forward_kind == EVALGRAD  # with grad in eval mode: evaluation unless a backward follows
        self.begin = begin
        self.end = begin
        self.samples = 0
        self.mark = mark
        self.end_mark: Any = None
        self.exhausted = False  # a fetch that raised (the loader's StopIteration at an epoch's end)
        self.opens = key == NEW_EPOCH or key == NEW_EVAL_EPOCH  # iter(loader): a loader's epoch begins, no batch
        self.trains = key == NEW_EPOCH  # and it begins for training

    @property
    def batch(self) -> bool:
        """A fetch that brought a batch: neither a loader's end nor its new epoch."""
        return self.kind == "data" and not self.exhausted and not self.opens


def _dropped_by_zip(segs: list[_Segment]) -> range:
    """Indexes of the batches a stretch outside the steps begins with, where a loader's end follows them with
    nothing between: ``zip(source, target)`` fetched the source's next batch, found the target done, and dropped
    the batch (an evaluation's batches follow its loader's new epoch instead)."""
    n = 0
    while n < len(segs) and segs[n].batch:
        n += 1
    return range(n if n < len(segs) and segs[n].kind == "data" and segs[n].exhausted else 0)


def _evaluates(seg: _Segment, trained: set[Any], backward_next: bool) -> bool:
    """``seg`` is an evaluation forward: a no-grad call of a trained module or of a copy of it, or one with grad in
    eval mode (``model.eval()`` without ``torch.no_grad()``) unless a backward comes next (a loop that trains in eval
    mode: it forgot ``model.train()``)."""
    return (seg.kind == "forward" and (seg.copy or seg.key in trained)
            and not (seg.evalgrad and backward_next))


def _step_begins(segs: list[_Segment], last_eval: int, fetches: int = 0) -> int:
    """Where the step's own work begins among ``segs`` (held before training work came), ``last_eval`` the last
    evaluation forward among them (-1: none): at the fetches after it, the last run of them (several loaders
    zipped, an epoch's end and start, a loader fetching ahead, a batch skipped), except where an evaluation's
    loader began an epoch in that run (iterated under ``no_grad``: a probe whose batches go to a submodule or to no
    module at all): then at the training loader's new epoch after it, or at the step's own fetches (``fetches``
    of them, as many as the loop's steps take) after the evaluation's batches and its loader's end; with none
    after it, at the fetch right before the no-grad passes it ends, which ran on that batch (a reference pass of
    the trained model, DPO's; a target network); else after it (no-grad forwards of modules never trained,
    teachers, stay in)."""
    data = [i for i in range(last_eval + 1, len(segs)) if segs[i].kind == "data"]
    floor = last_eval
    if not data and last_eval >= 0:
        before = [i for i in range(last_eval) if segs[i].kind == "data"]
        if before and all(segs[i].kind == "forward" for i in range(before[-1] + 1, last_eval + 1)):
            data, floor = before, max((i for i in range(before[-1]) if segs[i].kind != "data"), default=-1)
    if not data:
        return last_eval + 1
    last = start = data[-1]
    while start - 1 > floor and segs[start - 1].kind == "data":
        start -= 1
    if floor == last_eval >= 0:  # fetches after an evaluation's last pass: the training loader's new epoch (the
        # last run of them: zipped loaders) begins the step, and what came before it is the evaluation's: a batch
        # fetched as it broke off its loader, the loaders' ends (the fetch that found one done, its workers'
        # shutdown); without a new epoch, the step's fetches come after the last loader's end
        new = max((k for k in range(start, last + 1) if segs[k].trains), default=-1)
        while new - 1 >= start and segs[new - 1].trains:
            new -= 1
        ended = max((k for k in range(start, last + 1) if segs[k].exhausted), default=-1)
        if new >= 0 or ended >= 0:
            start = new if new >= 0 else ended + 1
            if start > last:
                return start
    probe = max((k for k in range(start, last + 1) if segs[k].opens and not segs[k].trains), default=-1)
    if probe < 0:
        return start  # no evaluation's loader among them: all the step's, as a zip's or an epoch's turn
    k = last
    while k > probe and not segs[k].exhausted and not segs[k].trains:
        k -= 1
    if k > probe and segs[k].trains:  # the training loader's new epoch (every zipped loader's), with its batches
        while k - 1 > probe and segs[k - 1].trains:  # (all of them: a loader that fetches ahead)
            k -= 1
        return k
    begin, taken = last, 0  # after the evaluation's batches (and its loader's end): the step's own fetches
    for i in range(last, k, -1):
        if segs[i].batch:
            if taken >= max(fetches, 1):
                break
            taken += 1
        begin = i
    return begin


def _absorb(part: _Part, segs: list[_Segment]) -> None:
    """Segments seen before a step's training work turn out to be that step's: their phase time, CUDA marks and
    samples go into ``part``."""
    for seg in segs:
        if seg.kind in part.acc:
            part.acc[seg.kind] += seg.end - seg.begin
            if seg.mark is not None and seg.end_mark is not None:
                part.mark_list(seg.kind).append((seg.mark, seg.end_mark))
        part.samples += seg.samples


class StepTracker:
    """Feed events in order with :meth:`feed`; completed steps come back one at a time."""

    def __init__(self) -> None:
        self.count = 0
        self.explicit = False
        self.outside = dict.fromkeys(OUTSIDE, 0.0)  # seconds outside steps, drained by the agent
        self._stack: list[tuple[str, Any]] = []  # open phases: name, begin mark
        self._since = 0.0  # when the innermost open phase last resumed
        #: the open closure ran a forward or backward: an evaluation to count (Lightning's manual optimization hands
        #: the optimizer a closure that does nothing; counted, it read "closures 2.0 evaluations per step")
        self._closure_worked = False
        self._trained: set[Any] = set()  # module keys seen in a forward with grad
        self._optimizers_seen = False
        self._part: _Part | None = None  # the step being built (None: nothing since the last one)
        self._done: _Part | None = None  # ended at an optimizer step, waiting for the boundary
        self._training = False  # the current part saw training work (grad forward, backward, optimizer)
        self._segments: list[_Segment] = []  # before training work: candidates for "outside"
        #: the end of a backward in a step that goes on (gradient accumulation): what comes before its next training
        #: work is held as segments, and may be an evaluation inside the step (None: not held)
        self._resume_from: float | None = None
        self._last_t = 0.0
        self._prefetch = 0.0  # seconds of other threads' fetches since the last step was made
        self._prefetch_samples = 0  # and the samples they fetched
        self._eval_keys_of: list[_Segment] | None = None  # the segments _eval_keys holds the eval-mode modules of
        self._eval_keys_seen = 0
        self._eval_keys: set[Any] = set()
        #: the most fetches a step began with, learned where steps begin with several (zipped loaders); a steady
        #: loop's one fetch a step needs no count (0 reads as 1), so the fast paths keep none
        self._fetches = 0

    # -- public -----------------------------------------------------------------------------
    def feed_many(self, events: list[tuple[int, float, Any, Any]]) -> list[StepRecord]:
        """:meth:`feed` over a batch of ``(code, t, arg, mark)`` events; returns the steps they completed.

        The same result as feeding them one by one (tests compare the two). A loop in its steady state (one
        optimizer whose step ends the step, host timing, nothing between the steps) takes a fast path: each
        iteration's 6 or 8 events are matched whole and turned into its step without the general state
        machine, which is what keeps the agent's thread cheap at thousands of steps a second.
        """
        out: list[StepRecord] = []
        feed = self.feed
        i, n = 0, len(events)
        if self._steady_state():
            i = self._steady(events, 0, out)
        while i < n:
            event = events[i]
            i += 1
            if event[0] == STEADY:  # not where the fast path can take it: the events it stands for, one by one
                done = False
                for sub in expand_steady(event):
                    rec = feed(*sub)
                    if rec is not None:
                        out.append(rec)
                        done = True
                if done and self._steady_state():
                    i = self._steady(events, i, out)
                continue
            rec = feed(*event)
            if rec is not None:
                out.append(rec)
                if self._steady_state():
                    i = self._steady(events, i, out)
        return out

    def _steady_state(self) -> bool:
        """Right after a step ended at its optimizer with nothing pending: the fast path may start here."""
        part = self._part
        return (part is not None and not self._stack and self._done is None and not self._segments
                and not self._training and not self.explicit and self._optimizers_seen and part.marks is NO_MARKS
                and part.start_mark is None and part.samples == 0 and part.closures == 0 and part.end == part.start
                and not any(part.acc.values()) and not self._prefetch)

    def _steady(self, events: list[tuple[int, float, Any, Any]], i: int, out: list[StepRecord]) -> int:
        """Steps of the two steady shapes, from ``events[i]`` on, for as long as they come; returns where the
        general path takes over. [data] forward(grad) backward optimizer, each begun and ended at top level,
        the optimizer's end ending the step (END_BOUNDARY), no CUDA marks: what :meth:`feed` makes of exactly
        these events, without its state machine."""
        n = len(events)
        count = first = self.count
        start = self._part.start  # type: ignore[union-attr]
        trained = self._trained
        while i < n:
            c0, t0, a0, m0 = events[i]
            if c0 == STEADY and _steady_steps is not None:  # a run of them, in C: the same steps, as SteadyStep
                i, count, start = _steady_steps(events, i, count, start, trained, out, NO_MARKS)
                if i == n or events[i][0] != STEADY:
                    continue
                c0, t0, a0, m0 = events[i]  # one C could not read: the Python below takes it
            if c0 == STEADY:  # folded by the C ring: the same step from one tuple (t0: the optimizer's end)
                t_fetch, t_fetched, samples, t2, key, t3, t4, t5, t6, _ = a0
                trained.add(key)
                count += 1
                out.append(StepRecord(count, start, t0, {
                    "data": t_fetched - t_fetch if t_fetch is not None else 0.0, "forward": t3 - t2,
                    "backward": t5 - t4, "optimizer": t0 - t6}, samples or None, NO_MARKS, 0))
                start = t0
                i += 1
                continue
            if i + 6 > n or c0 != BEGIN or m0 is not None:
                break
            j = i  # where the training work's six events begin: after the fetch, in a DataLoader loop
            data, samples = 0.0, 0
            if a0 == "data":
                if i + 8 > n:
                    break
                c1, t1, a1, m1 = events[i + 1]
                if c1 != END or m1 is not None:
                    break
                data = t1 - t0
                samples = a1[1] if type(a1) is tuple and a1[1] else 0
                j = i + 2
            (c2, t2, a2, m2), (c3, t3, _, m3), (c4, t4, a4, m4), (c5, t5, _, m5), (c6, t6, a6, m6), \
                (c7, t7, _, m7) = events[j : j + 6]
            if not (c2 == BEGIN and type(a2) is tuple and a2[0] == "forward" and a2[2] == GRAD and c3 == END
                    and c4 == BEGIN and a4 == "backward" and c5 == END and c6 == BEGIN and a6 == "optimizer"
                    and c7 == END_BOUNDARY and m2 is None and m3 is None and m4 is None and m5 is None
                    and m6 is None and m7 is None):
                break
            if a2[1] is not None:
                trained.add(a2[1])
            count += 1
            out.append(StepRecord(count, start, t7, {"data": data, "forward": t3 - t2, "backward": t5 - t4,
                                                     "optimizer": t7 - t6}, samples or None, NO_MARKS, 0))
            start = t7
            i = j + 6
        if count != first:
            self.count = count
            self.fast_steps += count - first
            self._part = _Part(start, None)
            self._since = self._last_t = start
        return i

    fast_steps = 0  # steps the fast path made (benchmarks and tests read it)

    def feed(self, code: int, t: float, arg: Any = None, mark: Any = None) -> StepRecord | None:
        """Apply one event; return the step it completed, if any.

        The agent's hot loop (several events per step at any step rate): the common cases, a phase
        beginning or ending with a step under way, are handled inline.
        """
        if code == PREFETCH:  # another thread's fetch: the step it ended in counts it, nothing else changes
            self._prefetch += arg[0]
            self._prefetch_samples += arg[1] or 0
            return None
        self._last_t = t
        if code == BEGIN:
            if type(arg) is tuple:
                phase, key, kind = arg
                if kind == GRAD and key is not None:
                    self._trained.add(key)
            else:
                phase, key, kind = arg, None, GRAD
            stack = self._stack
            if stack:
                top = stack[-1][0]
                if top in PHASES and (self._training or self.explicit):
                    part = self._part
                    if part is None:
                        part = self._part = _Part(t, None)
                    part.acc[top] += t - self._since
                if phase == CLOSURE:
                    self._closure_worked = False
                elif phase == "forward" or phase == "backward":
                    self._closure_worked = True
            else:
                part = self._part
                if part is None:
                    part = self._part = _Part(t, mark)
                if not (self._training or self.explicit):
                    paired = phase == "forward" and kind == GRAD and self._evaluating_with_grad(key)
                    if paired:
                        kind = EVALGRAD
                    if phase == "backward" or phase == "optimizer" or (phase == "forward" and kind == GRAD):
                        if self._resume_from is None:
                            self._start_training(t, part, phase != "forward")
                        else:
                            self._resume_training(t, part, phase != "forward")
                    else:
                        self._segments.append(_Segment(phase, key, kind, t, mark, paired))
            stack.append((phase, mark))
            self._since = t
            return None
        if code == END or code == END_BOUNDARY:
            stack = self._stack
            if not stack:  # unbalanced end (an exception skipped a begin): ignore
                return self._commit() if code == END_BOUNDARY else None
            phase, begin_mark = stack.pop()
            if phase == CLOSURE and self._closure_worked:
                self._current(t, mark).closures += 1
            part = self._part
            if phase in PHASES and (self._training or self.explicit):
                if part is None:
                    part = self._part = _Part(t, None)
                part.acc[phase] += t - self._since
            self._since = t
            if not stack and part is not None:
                self._ended(phase, begin_mark, part, arg, t, mark)
            return self._commit() if code == END_BOUNDARY else None
        if code == BOUNDARY:
            return self._commit()
        if code == STEP:
            return self._explicit_step(t, mark)
        if code == OPTIMIZER_CREATED:
            self._optimizers_seen = True
        return None

    def finish(self, end: float | None = None) -> StepRecord | None:
        """The job ended (at ``end``; None: at its last event): a step whose optimizer (or manual backward) ran is
        complete, and what ran after the last step (a final evaluation, the script's own end: writing results) is
        outside time."""
        rec = self._commit()
        end = self._last_t if end is None else max(end, self._last_t)
        if self._resume_from is not None:  # ended inside a step that never stepped: that step is not recorded,
            segs = self._segments  # but an evaluation after its last backward is outside time, as anywhere
            if any(_evaluates(seg, self._trained, False) for seg in segs):
                self.outside["evaluation"] += max(0.0, end - self._resume_from)
            self._resume_from, self._segments = None, []
        if self._part is not None and not self._training and (self._segments or self.count):
            self._settle_outside(end, len(self._segments))
            self._segments = []
            self._part = None
        return rec

    def _evaluating_with_grad(self, key: Any) -> bool:
        """The batch held last went through a module in eval mode with grad: another module, in train mode, called
        after it (a loss with parameters of its own, a center loss or an ArcFace margin, which ``model.eval()`` left
        in train mode) is that evaluation's too, unless a backward follows (then both are the step's). A module
        held in eval mode and now in train mode is the training's (``model.train()``, then the next step)."""
        segs = self._segments
        last = next((seg for seg in reversed(segs) if seg.kind != CHECKPOINT), None)
        if last is None or last.kind != "forward" or not last.evalgrad:
            return False
        if self._eval_keys_of is not segs:  # the modules held in eval mode, kept as segments come (linear)
            self._eval_keys_of, self._eval_keys_seen, self._eval_keys = segs, 0, set()
        for seg in segs[self._eval_keys_seen:]:
            if seg.evalgrad and not seg.paired:
                self._eval_keys.add(seg.key)
        self._eval_keys_seen = len(segs)
        return key not in self._eval_keys

    def drain_outside(self) -> dict[str, float]:
        """Seconds outside steps since the last call (only the non-zero kinds)."""
        out = {k: v for k, v in self.outside.items() if v > 0}
        if out:
            self.outside = dict.fromkeys(OUTSIDE, 0.0)
        return out

    # -- phases -------------------------------------------------------------------------------
    def _ended(self, phase: str, begin_mark: Any, part: _Part, arg: Any, t: float, mark: Any) -> None:
        """A top-level phase ended."""
        samples = arg[1] if phase == "data" and type(arg) is tuple and arg[1] else 0
        if not (self._training or self.explicit):
            if self._segments:
                seg = self._segments[-1]
                seg.end, seg.end_mark, seg.samples = t, mark, seg.samples + samples
                if phase == "data" and type(arg) is tuple and arg[1] is False:
                    seg.exhausted = True
            return
        if mark is not None and begin_mark is not None and phase in part.acc:
            part.mark_list(phase).append((begin_mark, mark))
        part.samples += samples
        if self.explicit:
            return
        if phase == "optimizer":
            self._optimizers_seen = True
        elif phase != "backward" or self._optimizers_seen:
            if phase == "backward":  # gradient accumulation: until the next training work, hold what comes (an
                self._resume_from, self._training = t, False  # evaluation every N micro-batches: Lightning's)
            return
        # The step may end here: the boundary (next iteration) confirms it, or a second
        # optimizer of the same iteration (GAN: D then G) moves the end further.
        part.end, part.end_mark = t, mark
        if self._done is None:
            self._done = part
        else:
            self._done.absorb(part)
        self._part = _Part(t, mark)

    # -- boundaries ----------------------------------------------------------------------------
    def _current(self, t: float, mark: Any) -> _Part:
        if self._part is None:
            self._part = _Part(t, mark)
        return self._part

    def _start_training(self, t: float, part: _Part, backward_next: bool = False) -> None:
        """Training work began (``backward_next``: a backward or an optimizer step, not a forward): decide where this
        step started and what before it was outside."""
        segs = self._segments
        trained_from = len(segs)  # forwards read as an evaluation's (a module in train mode after one in eval mode)
        if backward_next:  # that a backward follows were the training's: it began at them (a GAN's D(real) after
            while trained_from and segs[trained_from - 1].kind == "forward" and segs[trained_from - 1].paired:
                trained_from -= 1  # sampling with G.eval() and grad)
            backward_next = trained_from == len(segs)
        self._train_forwards(segs, backward_next)
        if not segs:  # nothing before the training work (the common case): the step began with it
            self._training = True
            return
        if len(segs) == 1 and segs[0].kind == "data":
            # a DataLoader loop's every step: its fetch began it (what the general case below decides)
            _absorb(part, segs)
            self._segments = []
            self._training = True
            return
        trained = self._trained
        last_eval = max((i for i, s in enumerate(segs[:trained_from]) if _evaluates(s, trained, backward_next)),
                        default=-1)
        start = _step_begins(segs, last_eval, self._fetches)
        self._fetches = max(self._fetches, sum(1 for s in segs[start:] if s.batch))
        saved = start
        while start < len(segs) and segs[start].kind == CHECKPOINT:
            start += 1  # a torch.save before the iteration's first fetch or forward: outside, as between steps
        if start > 0:
            if start > saved:  # the step begins as the save ends: the loop's own work after it (a batch built) is in
                begin, begin_mark = segs[start - 1].end, segs[start - 1].end_mark
            else:
                begin, begin_mark = (segs[start].begin, segs[start].mark) if start < len(segs) else (t, None)
            self._settle_outside(begin, start)
            part = self._part = _Part(begin, begin_mark)
        _absorb(part, segs[start:])
        self._segments = []
        self._training = True

    def _train_forwards(self, segs: list[_Segment], backward_next: bool) -> None:
        """With a backward next, forwards with grad in eval mode are the training's: their modules are trained."""
        if backward_next:
            self._trained.update(s.key for s in segs if s.evalgrad and s.key is not None)

    def _resume_training(self, t: float, part: _Part, backward_next: bool = False) -> None:
        """Training work came back in a step that held what followed its last backward: evaluation forwards in there
        (a no-grad call of a trained model or a copy of it) and the fetches for them are outside the step, from that
        backward's end to the fetches of the next micro-batch; the rest (the next micro-batch's fetch, a frozen
        teacher's forward) is the step's."""
        segs, since = self._segments, self._resume_from
        assert since is not None
        self._resume_from, self._segments, self._training = None, [], True
        self._train_forwards(segs, backward_next)
        trained = self._trained
        last_eval = max((i for i, s in enumerate(segs) if _evaluates(s, trained, backward_next)), default=-1)
        start = _step_begins(segs, last_eval, self._fetches)
        if start == 0:  # the next micro-batch's fetch (the common case), or its reference pass
            _absorb(part, segs)
            return
        until = segs[start].begin if start < len(segs) else t
        total = max(0.0, until - since)
        ckpt = min(total, sum(s.end - s.begin for s in segs[:start] if s.kind == CHECKPOINT))
        self.outside["checkpoint"] += ckpt
        self.outside["evaluation"] += total - ckpt
        part.start += total  # the step's time leaves it out: its duration and "other" are its training's
        part.start_mark = None  # the device's step time would hold it: not measured for this step
        _absorb(part, segs[start:])

    def _settle_outside(self, until: float, upto: int) -> None:
        """Everything from the part's start to ``until`` is outside steps; say what it was."""
        part = self._part
        if part is None:
            return
        total = max(0.0, until - part.start)
        segs = self._segments[:upto]
        ckpt = min(total, sum(s.end - s.begin for s in segs if s.kind == CHECKPOINT))
        self.outside["checkpoint"] += ckpt
        # an epoch's end (the fetch that finds the loader done, and its workers' shutdown) and a training loader's
        # new epoch (its workers' start) are not evaluation; what comes before the evaluation's first fetch or pass
        # (an EMA or Polyak update after the optimizer step, the next stage's loader built) is not either
        # (a loader whose epoch began with grad enabled and whose batch came next, outside the steps, is an
        # evaluation's iterated outside no_grad: HF Trainer's evaluation_loop, no_grad only in prediction_step)
        # (the batches zipped loaders fetched as the shortest one ended, which zip dropped, belong to no evaluation)
        dropped = _dropped_by_zip(segs)
        first = next((s for i, s in enumerate(segs) if s.kind != CHECKPOINT and not s.exhausted and i not in dropped
                      and (not s.trains or (i + 1 < len(segs) and segs[i + 1].batch))), None)
        if first is None or not any(s.kind != CHECKPOINT and not s.exhausted and not s.opens and i not in dropped
                                    for i, s in enumerate(segs)):
            self.outside["other"] += total - ckpt
            return
        saved = sum(s.end - s.begin for s in segs if s.kind == CHECKPOINT and s.end <= first.begin)
        lead = min(max(0.0, first.begin - part.start - saved), total - ckpt)
        self.outside["other"] += lead
        self.outside["evaluation"] += total - ckpt - lead

    def _commit(self) -> StepRecord | None:
        done = self._done
        if done is None:
            return None
        self._done = None
        part = self._part
        acc = part.acc if part is not None else None
        if acc is None or not (acc["forward"] or acc["backward"] or acc["optimizer"]):
            self._training = False  # the next iteration starts undecided: evaluation may come first
        return self._record(done)

    def _explicit_step(self, t: float, mark: Any) -> StepRecord | None:
        first = not self.explicit
        self.explicit = True
        part = self._current(t, mark)
        if first:
            _absorb(part, self._segments)  # undecided fetches and forwards are this step's
            self._segments = []
            if self._done is not None:
                self._done.absorb(part)  # the automatic end was not the end: this call is
                part, self._done = self._done, None
            elif part.start == t and not self._stack:
                return None  # step() with nothing before it: this call starts the clock
        part.end, part.end_mark = t, mark
        self._part = _Part(t, mark)
        return self._record(part)

    def _record(self, part: _Part) -> StepRecord:
        self.count += 1
        marks = part.marks  # the part is done with: its dicts become the record's
        if part.end_mark is not None and part.start_mark is not None:
            part.mark_list("step").append((part.start_mark, part.end_mark))
            marks = part.marks
        prefetch, self._prefetch = self._prefetch, 0.0
        samples = part.samples + self._prefetch_samples  # a prefetching thread's batches are the step's samples
        self._prefetch_samples = 0
        return StepRecord(self.count, part.start, part.end, part.acc, samples or None, marks, part.closures,
                          prefetch)
