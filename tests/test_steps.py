"""Step detection on synthetic hook-event sequences, one loop shape per case."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from perfmon.agent.steps import (
    BEGIN,
    BOUNDARY,
    CLOSURE,
    COPY,
    END,
    EVALGRAD,
    GRAD,
    NEW_EPOCH_BEGINS,
    NEW_EVAL_EPOCH_BEGINS,
    NOGRAD,
    OPTIMIZER_CREATED,
    PREFETCH,
    STEP,
    UNSTEPPED_PATIENCE,
    Boundaries,
    StepTracker,
)

MADE = -1  # Seq's own code: an optimizer is built
BUILT = -2  # Seq's own code: optimizers built before the loop, by key (the hooks note each as it is built)


class Seq:
    """Builds an event sequence with a fake clock: each phase takes the ms given.

    ``run`` passes the events through :class:`Boundaries` first, as the hooks do, so the
    tracker sees the BOUNDARY events the training thread would commit.
    """

    def __init__(self) -> None:
        self.t = 0.0
        self.events: list[tuple[int, float, object, object]] = []  # code, t, arg, optimizer key

    def gap(self, ms: float) -> Seq:
        self.t += ms / 1000
        return self

    def phase(self, name: str, ms: float, samples: int | None = None, inner: list[tuple] = (),
              opt: str = "opt", arg: object = None) -> Seq:
        key = opt if name == "optimizer" else arg[2] if isinstance(arg, tuple) else None
        self.events.append((BEGIN, self.t, arg or name, key))
        for sub in inner:  # (name, ms) or (name, ms, its own inner phases)
            self.phase(sub[0], sub[1], inner=sub[2] if len(sub) > 2 else ())
        self.t += ms / 1000
        end = (name, samples) if name == "data" else (name, key) if name == "optimizer" else name
        self.events.append((END, self.t, end, key))
        return self

    def mark(self, code: int) -> Seq:
        self.events.append((code, self.t, None, None))
        return self

    def made(self) -> Seq:
        """An optimizer is built here (the hooks' patched ``Optimizer.__init__``)."""
        self.events.append((MADE, self.t, None, None))
        return self

    def built(self, *keys: str) -> Seq:
        """Optimizers built before the loop (the hooks' patched ``Optimizer.__init__``, for each)."""
        self.events.append((BUILT, self.t, keys, None))
        return self

    def forward(self, ms: float, module: str = "model", grad: bool = True, kind: int | None = None) -> Seq:
        kind = kind if kind is not None else (GRAD if grad else NOGRAD)
        return self.phase("forward", ms, arg=("forward", module, kind))

    def nograd_forward(self, ms: float, module: str = "model") -> Seq:
        return self.forward(ms, module, grad=False)

    def run(self, tracker: StepTracker | None = None, end: float | None = None) -> list:
        tracker = tracker or StepTracker()
        bounds = Boundaries()
        out = []
        for code, t, arg, key in self.events:
            if arg == CLOSURE:  # the closure's wrapper emits its events without asking Boundaries
                out.append(tracker.feed(code, t, arg))
                continue
            if code == BEGIN:
                phase = arg[0] if isinstance(arg, tuple) else arg
                if bounds.begin(phase, key):
                    out.append(tracker.feed(BOUNDARY, t))
            elif code == END:
                out.append(tracker.feed(code, t, arg))
                if bounds.end(arg[0] if isinstance(arg, tuple) else arg, key):
                    out.append(tracker.feed(BOUNDARY, t))
                continue
            elif code == STEP:
                bounds.explicit = True
            elif code == OPTIMIZER_CREATED:
                bounds.optimizers_seen = True
            elif code == BUILT:
                bounds.unstepped.update(arg)
                if not bounds.optimizers_seen:
                    bounds.optimizers_seen = True
                    out.append(tracker.feed(OPTIMIZER_CREATED, t))
                continue
            elif code == MADE:  # as the hooks do: the first one says an optimizer exists, a later one may commit
                if not bounds.optimizers_seen:
                    bounds.optimizers_seen = True
                    out.append(tracker.feed(OPTIMIZER_CREATED, t))
                elif bounds.optimizer_made():
                    out.append(tracker.feed(BOUNDARY, t))
                continue
            out.append(tracker.feed(code, t, arg))
        out.append(tracker.finish(end))  # the job's end (None: its last event)
        return [r for r in out if r is not None]


def optimizer_loop(s: Seq, steps: int, batch: int = 32) -> Seq:
    s.mark(OPTIMIZER_CREATED)
    for _ in range(steps):
        s.phase("data", 1, batch).phase("forward", 2).gap(0.5).phase("backward", 3).phase("optimizer", 1).gap(0.5)
    return s


def test_dataloader_optimizer_loop_counts_each_step_and_each_phase():
    steps = optimizer_loop(Seq(), 5).run()
    assert [r.index for r in steps] == [1, 2, 3, 4, 5]
    first, second = steps[0], steps[1]
    assert first.phases == pytest.approx({"data": 0.001, "forward": 0.002, "backward": 0.003, "optimizer": 0.001})
    assert first.duration == pytest.approx(0.0075)  # starts at the first data fetch
    # later steps start where the previous one ended: the trailing gap is "other"
    assert second.duration == pytest.approx(0.008)
    assert second.other == pytest.approx(0.001)
    assert all(r.samples == 32 for r in steps)


def test_manual_updates_without_optimizer_end_at_next_forward():
    s = Seq()
    for _ in range(4):
        s.phase("forward", 2).phase("backward", 3).gap(1)  # the gap is the manual update
    steps = s.run()
    assert len(steps) == 4  # the last one completes when the job ends
    assert steps[0].phases["forward"] == pytest.approx(0.002)
    # a step ends at its backward; the update after it is the next step's "other"
    assert steps[1].other == pytest.approx(0.001)


def test_gradient_accumulation_is_one_step_per_optimizer_step():
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(3):
        for _ in range(4):
            s.phase("data", 1, 8).phase("forward", 1).phase("backward", 1)
        s.phase("optimizer", 1)
    steps = s.run()
    assert len(steps) == 3
    assert steps[0].phases["backward"] == pytest.approx(0.004)
    assert steps[0].samples == 32


def test_accumulation_before_first_optimizer_step_needs_optimizer_created():
    # without the optimizer-created event the first backward->forward would split the step
    s = Seq().mark(OPTIMIZER_CREATED)
    s.phase("forward", 1).phase("backward", 1).phase("forward", 1).phase("backward", 1).phase("optimizer", 1)
    assert len(s.run()) == 1


def test_lbfgs_closure_phases_are_charged_to_the_innermost_phase():
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(2):
        s.phase("data", 1, 16)
        # as the hooks emit it: each closure call wrapped (the closure's own work here takes no time)
        s.phase("optimizer", 2, inner=[("closure", 0, [("forward", 1), ("backward", 1)]),
                                       ("closure", 0, [("forward", 1), ("backward", 1)])])
    steps = s.run()
    assert len(steps) == 2
    assert steps[0].phases["forward"] == pytest.approx(0.002)  # two closure evaluations, 1 ms each
    assert steps[0].phases["backward"] == pytest.approx(0.002)
    assert steps[0].phases["optimizer"] == pytest.approx(0.002)  # its own work only
    assert steps[0].duration == pytest.approx(0.007)  # nothing counted twice: phases add up to the step
    assert steps[0].other == pytest.approx(0.0)
    assert steps[0].closures == 2


def test_closure_own_work_is_other_and_each_closure_counts_once():
    """PyTorch Lightning steps every optimizer through ``step(closure)``: the closure's own work (the loss, its
    hooks and logging, ``zero_grad``) is the script's time ("other"), as in a plain loop, not the optimizer's."""
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(2):
        s.phase("data", 1, 16)
        s.phase("optimizer", 1, inner=[("closure", 4, [("forward", 1), ("backward", 2)]), ("closure", 1)])
    steps = s.run()
    assert len(steps) == 2
    first = steps[0]
    assert first.phases["optimizer"] == pytest.approx(0.001)  # its own work only
    assert (first.phases["forward"], first.phases["backward"]) == (pytest.approx(0.001), pytest.approx(0.002))
    assert first.other == pytest.approx(0.005)  # the two closures' own 4 + 1 ms
    assert first.duration == pytest.approx(0.010)
    assert first.closures == 1  # the second ran no forward or backward: no evaluation (Lightning's manual
    # optimization passes a closure that does nothing; "closures 2.0 evaluations per step" told nothing)


def test_other_threads_fetches_count_in_the_step_they_end_in_and_change_nothing_else():
    """A prefetching thread's fetches (PREFETCH events, from another thread) are counted apart in the step during
    which each ended; the steps, their phases and their times are what they are without them."""
    plain = optimizer_loop(Seq(), 4)
    s = optimizer_loop(Seq(), 4)
    # a fetch of 6 ms ending inside step 2's forward, two ending inside step 4's own fetch
    at = [k for k, ev in enumerate(s.events) if ev[0] == BEGIN and ev[2] == "forward"]
    s.events.insert(at[1] + 1, (PREFETCH, s.events[at[1]][1] + 0.0005, (0.006, 16), None))
    t4 = s.events[at[3] - 2][1]  # step 4's data begins
    s.events[at[3] - 1 : at[3] - 1] = [(PREFETCH, t4 + 0.0001, (0.002, 16), None), (PREFETCH, t4 + 0.0002, (0.003, None), None)]
    steps, reference = s.run(), plain.run()
    assert [st.prefetch for st in steps] == [0.0, pytest.approx(0.006), 0.0, pytest.approx(0.005)]
    assert [st.samples for st in steps] == [32, 48, 32, 48]  # the thread's batches are the steps' samples too
    assert [(st.index, st.start, st.end, st.phases) for st in steps] == [
        (st.index, st.start, st.end, st.phases) for st in reference]


def test_grad_scaler_step_wrapping_optimizer_step_is_one_phase():
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(3):
        s.phase("forward", 1).phase("backward", 1).phase("optimizer", 1, inner=[("optimizer", 1)])
    steps = s.run()
    assert len(steps) == 3
    assert steps[0].phases["optimizer"] == pytest.approx(0.002)


def test_skipped_scaler_step_still_ends_the_step():
    # scaler.step() found infs and skipped optimizer.step(): the outer phase still ends the step
    s = Seq().mark(OPTIMIZER_CREATED)
    s.phase("forward", 1).phase("backward", 1).phase("optimizer", 1)
    s.phase("forward", 1).phase("backward", 1).phase("optimizer", 1)
    assert len(s.run()) == 2


def test_evaluation_forwards_are_not_steps_and_do_not_inflate_the_next_step():
    s = optimizer_loop(Seq(), 2)
    for _ in range(5):
        s.phase("data", 1, 32).nograd_forward(10)
    optimizer_loop(s, 2)
    steps = s.run()
    assert len(steps) == 4
    # the step after eval holds at most one eval data fetch, never the eval forwards
    assert steps[2].phases["forward"] == pytest.approx(0.002)
    assert steps[2].duration < 0.012


def test_single_nograd_forward_in_a_step_is_part_of_it():
    # a frozen teacher / target network under no_grad is training work
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(3):
        s.phase("data", 1, 8).nograd_forward(2).phase("forward", 2).phase("backward", 2).phase("optimizer", 1)
    steps = s.run()
    assert len(steps) == 3
    assert steps[1].phases["forward"] == pytest.approx(0.004)
    assert steps[1].phases["data"] == pytest.approx(0.001)


def test_explicit_step_calls_take_over():
    s = Seq()
    for _ in range(3):
        s.phase("data", 1).phase("forward", 1).phase("backward", 1).gap(1).mark(STEP)
    steps = s.run()
    assert len(steps) == 3
    assert steps[0].other == pytest.approx(0.001)


def test_explicit_step_after_optimizer_step_does_not_make_empty_steps():
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(4):
        s.phase("forward", 1).phase("backward", 1).phase("optimizer", 1).mark(STEP)
    steps = s.run()
    assert len(steps) == 4
    assert all(r.duration > 0.0025 for r in steps[1:])


def test_explicit_phase_wrapping_an_auto_phase_counts_once():
    s = Seq()
    for _ in range(2):
        s.phase("forward", 3, inner=[("forward", 1)]).phase("backward", 1).mark(STEP)
    steps = s.run()
    assert steps[0].phases["forward"] == pytest.approx(0.004)


def test_unbalanced_end_is_ignored():
    tracker = StepTracker()
    assert tracker.feed(END, 0.0, "forward") is None
    assert tracker.feed(BEGIN, 0.1, "forward") is None
    assert tracker.feed(END, 0.2, "forward") is None


# -- the loop shapes of real codebases ------------------------------------------------------------------
def gan_batch(s: Seq, loader: bool = True) -> Seq:
    """dcgan: D on real and fake, D step, then G through D, G step: one batch, one step."""
    if loader:
        s.phase("data", 1, 8)
    s.forward(1, "D").phase("backward", 1).forward(1, "G").forward(1, "D").phase("backward", 1)
    s.phase("optimizer", 1, opt="optD")
    s.forward(1, "D").phase("backward", 1).phase("optimizer", 1, opt="optG").gap(0.5)
    return s


@pytest.mark.parametrize("loader", [True, False], ids=["dataloader", "no-dataloader"])
def test_gan_two_optimizers_per_batch_is_one_step(loader):
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(5):
        gan_batch(s, loader)
    steps = s.run()
    assert len(steps) == 5
    for r in steps:
        assert r.phases["optimizer"] == pytest.approx(0.002)  # both optimizer steps
        assert r.phases["forward"] == pytest.approx(0.004)
    # every step holds the same work, the first included (no D/G alternation to look unstable)
    assert steps[0].duration == pytest.approx(0.010 if loader else 0.009)
    assert all(r.duration == pytest.approx(steps[0].duration + 0.0005) for r in steps[1:])


@pytest.mark.parametrize("first_g", [0, 4], ids=["generator-first-batch", "generator-fifth-batch"])
def test_wgan_every_batch_is_one_step(first_g):
    """Critic every batch, generator every 5th. While the generator has not stepped, no critic update ends its
    step at once (the generator's optimizer exists and may step in the same batch): its first update (batch 5)
    was a step of its own, 16 for 15 batches."""
    s = Seq().built("optD", "optG")
    for i in range(15):
        s.phase("data", 1, 8).forward(1, "D").phase("backward", 1).phase("optimizer", 1, opt="optD")
        if i % 5 == first_g:
            s.forward(1, "G").phase("backward", 1).phase("optimizer", 1, opt="optG")
    steps = s.run()
    assert len(steps) == 15 and {r.samples for r in steps} == {8}
    g_batches = [r for r in steps if r.phases["optimizer"] == pytest.approx(0.002)]
    assert [r.index for r in g_batches] == [first_g + 1, first_g + 6, first_g + 11]


@pytest.mark.parametrize("first_g", [0, 4], ids=["generator-first-batch", "generator-fifth-batch"])
def test_wgan_without_a_dataloader_is_one_step_a_batch(first_g):
    """No fetch begins the iterations: a forward after every optimizer of the loop stepped does. The generator's
    forward right after the critic's update began a step of its own while the generator had never stepped."""
    s = Seq().built("optD", "optG")
    for i in range(15):
        s.forward(1, "G").forward(1, "D").phase("backward", 1).phase("optimizer", 1, opt="optD")
        if i % 5 == first_g:
            s.forward(1, "G").phase("backward", 1).phase("optimizer", 1, opt="optG")
    assert len(s.run()) == 15


def stylegan_batch(s: Seq, d_reg: bool, g_reg: bool) -> Seq:
    """rosinality's stylegan2 train loop: a fetch, D's update, again with lazy R1 regularization every n batches
    (``d_reg``), G's update, again with path length regularization every m (``g_reg``); each extra update with a
    forward and a backward of its own."""
    s.phase("data", 1, 8)
    s.forward(1, "G").forward(1, "D").phase("backward", 1).phase("optimizer", 1, opt="optD")
    if d_reg:
        s.forward(1, "D").phase("backward", 1).phase("optimizer", 1, opt="optD")
    s.forward(1, "G").forward(1, "D").phase("backward", 1).phase("optimizer", 1, opt="optG")
    if g_reg:
        s.forward(1, "G").phase("backward", 1).phase("optimizer", 1, opt="optG")
    return s


@pytest.mark.parametrize(("phase", "first"), [(2, 0), (1, 2), (0, 2)], ids=["from-batch-2", "batch-1", "batch-0"])
def test_a_second_update_in_a_batch_of_a_dataloader_loop_is_the_same_step(phase, first):
    """Iterations that begin with a fetch end at the next fetch: a second update of D or G in a batch (StyleGAN's
    lazy regularization) was a step of its own (158 steps for 120 batches). From the third batch on: until two
    batches in a row began at a fetch, nothing says that the fetch begins the iterations (a batch fetched once and
    trained on many times looks the same; so does a validation DataLoader between epochs of training on tensors),
    so a second update in batch 0 or 1 still begins a step (rosinality's loop regularizes in batch 0: ``first``
    more steps)."""
    s = Seq().built("optD", "optG")  # before the loop, as the scripts build them
    for i in range(24):
        stylegan_batch(s, i % 4 == phase, i % 3 == phase)
    steps = s.run()
    assert len(steps) == 24 + first
    whole = [r for r in steps if r.samples == 8 and r.phases["forward"] > 0.0035]  # the batches not split
    assert len(whole) == 24 - (first > 0)
    assert sum(r.phases["optimizer"] for r in steps) == pytest.approx(
        0.001 * sum(2 + (i % 4 == phase) + (i % 3 == phase) for i in range(24)))
    later = steps[-(24 - 2):]  # batches 2..23: one step each, with its extra updates
    assert [round(r.phases["optimizer"] * 1000) for r in later] == [
        2 + (i % 4 == phase) + (i % 3 == phase) for i in range(2, 24)]


def test_a_batch_fetched_once_and_trained_on_many_times_is_a_step_an_update():
    """One fetch, then updates without fetching (overfitting one batch, Karpathy's first check): every update is an
    iteration, as before."""
    s = Seq().mark(OPTIMIZER_CREATED).phase("data", 1, 8)
    for _ in range(10):
        s.forward(1).phase("backward", 1).phase("optimizer", 1)
    assert len(s.run()) == 10


@pytest.mark.parametrize("first_eval", [False, True], ids=["after-each-epoch", "after-the-first-update-too"])
def test_an_evaluation_loader_between_epochs_does_not_make_the_training_one_step(first_eval):
    """Training on tensors, a validation DataLoader every epoch (and after the first update: a script that
    evaluates at step % N == 0): the step after a validation begins at a fetch, the one before it did not, so a
    second update there begins a step as in any loop without a DataLoader."""
    s = Seq().mark(OPTIMIZER_CREATED)
    for epoch in range(3):
        for i in range(6):
            s.forward(1).phase("backward", 1).phase("optimizer", 1)
            if (first_eval and epoch == 0 and i == 0) or i == 5:
                for _ in range(2):
                    s.phase("data", 1, 8).nograd_forward(1)
    assert len(s.run()) == 18


def test_an_optimizer_built_and_never_stepped_is_waited_for_a_while_only():
    """Built and never used (or used much later): while it is waited for, the loop's one optimizer ends no step
    at once (no fast path); after UNSTEPPED_PATIENCE steps the loop is the other's again."""
    bounds = Boundaries()
    bounds.optimizers_seen = True
    bounds.unstepped.update({"opt", "unused"})
    at_once = []
    for _ in range(UNSTEPPED_PATIENCE + 5):
        for phase, key in (("forward", GRAD), ("backward", None)):
            bounds.begin(phase, key)
            bounds.end(phase, key)
        bounds.begin("optimizer", "opt")
        at_once.append(bounds.end("optimizer", "opt"))
    assert not any(at_once[:UNSTEPPED_PATIENCE]) and all(at_once[UNSTEPPED_PATIENCE + 2:]), at_once
    assert not bounds.unstepped


def test_an_optimizer_nobody_knew_of_before_its_first_update_still_splits_that_batch():
    """Built before ``perfmon.instrument()`` (not seen until it steps): a critic update before the generator's
    first ends its step at once, so that batch counts twice; from then on every batch is one step."""
    s = Seq().built("optD")
    for i in range(15):
        s.phase("data", 1, 8).forward(1, "D").phase("backward", 1).phase("optimizer", 1, opt="optD")
        if i % 5 == 4:
            s.forward(1, "G").phase("backward", 1).phase("optimizer", 1, opt="optG")
    assert len(s.run()) == 16


@pytest.mark.parametrize("loader", [True, False], ids=["dataloader", "no-dataloader"])
def test_an_optimizer_built_every_iteration_begins_the_iteration(loader):
    """``opt = SGD(model.parameters())`` at the top of every iteration (a new optimizer each time, as some
    fine-tuning and meta-learning loops do) after a loop with a long-lived optimizer: one step per update, each
    holding its own work."""
    s = Seq().made()
    for _ in range(4):
        s.forward(1).phase("backward", 1).phase("optimizer", 1, opt="opt")
    for i in range(5):
        s.gap(0.5).made()
        if loader:
            s.phase("data", 1, 8)
        s.forward(1).phase("backward", 2).phase("optimizer", 1, opt=f"opt{i}")
    steps = s.run()
    assert len(steps) == 9
    for r in steps[4:]:
        assert r.phases["backward"] == pytest.approx(0.002) and r.phases["optimizer"] == pytest.approx(0.001)


def test_an_optimizer_built_per_epoch_keeps_the_count_and_the_loop_is_learned_again():
    s = Seq().made()
    for epoch in range(3):
        if epoch:
            s.made()  # progressive unfreezing: a new optimizer over the parameters now trained
        for _ in range(4):
            s.forward(1).phase("backward", 1).phase("optimizer", 1, opt=f"opt-epoch{epoch}")
    steps = s.run()
    assert len(steps) == 12
    assert all(r.phases["forward"] == pytest.approx(0.001) for r in steps)


def test_an_optimizer_built_inside_a_phase_or_before_training_commits_nothing():
    bounds = Boundaries()
    bounds.optimizers_seen = True
    assert bounds.optimizer_made() is False  # before any step: nothing waits to end
    bounds.begin("forward", GRAD)
    assert bounds.optimizer_made() is False  # built lazily inside the forward
    bounds.end("forward")
    bounds.begin("optimizer", "opt")
    bounds.end("optimizer", "opt")
    assert bounds.pending and bounds.optimizer_made() is True and not bounds.pending


def test_nanogpt_accumulation_without_loader_splits_the_first_step_right():
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(4):
        for _ in range(4):
            s.forward(1).gap(0.25).phase("backward", 1)
        s.phase("optimizer", 1, inner=[("optimizer", 1)]).gap(0.5)  # scaler.step(opt)
    steps = s.run()
    assert len(steps) == 4
    for r in steps:
        assert r.phases["forward"] == pytest.approx(0.004) and r.phases["backward"] == pytest.approx(0.004)


def test_grad_scaler_skipped_step_is_a_boundary():
    s = Seq().mark(OPTIMIZER_CREATED)
    for skipped in (False, True, False):  # a skipped step: scaler.step runs, optimizer.step does not
        s.phase("data", 1, 4).forward(1).phase("backward", 1)
        s.phase("optimizer", 0.2 if skipped else 1, inner=[] if skipped else [("optimizer", 1)])
    assert len(s.run()) == 3


def test_frozen_teacher_under_no_grad_is_forward_of_every_step():
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(4):
        s.phase("data", 1, 8).nograd_forward(3, "teacher").forward(2, "student").phase("backward", 2)
        s.phase("optimizer", 1)
    steps = s.run()
    assert len(steps) == 4
    assert all(r.phases["forward"] == pytest.approx(0.005) for r in steps)


def test_teacher_without_a_loader_stays_in_the_step():
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(3):
        s.nograd_forward(3, "teacher").forward(2, "student").phase("backward", 2).phase("optimizer", 1)
    steps = s.run()
    assert len(steps) == 3
    assert steps[2].phases["forward"] == pytest.approx(0.005)
    assert sum(StepTracker().outside.values()) == 0


def test_evaluation_between_steps_is_outside_time_not_the_next_step():
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for i in range(6):
        s.phase("data", 1, 8).forward(2).phase("backward", 3).phase("optimizer", 1).gap(0.5)
        if i == 2:  # validation: 20 batches of 72 samples under no_grad
            for _ in range(20):
                s.phase("data", 2, 72).nograd_forward(5)
    steps = s.run(tracker)
    assert len(steps) == 6
    after = steps[3]
    assert after.samples == 8 and after.duration == pytest.approx(0.007)
    # what ran before the validation's first fetch (the step's zero_grad, logging) is "other"
    assert tracker.outside["evaluation"] == pytest.approx(20 * 0.007)
    assert tracker.outside["other"] == pytest.approx(0.0005)


def _validated_mid_window(validation: Callable[[Seq], object]) -> Seq:
    """Three steps of two micro-batches (8 samples, 1 ms per phase); ``validation`` runs after step 2's first."""
    s = Seq().mark(OPTIMIZER_CREATED)
    for i in range(3):
        for micro in range(2):
            s.phase("data", 1, 8).forward(1).phase("backward", 1)
            if i == 1 and micro == 0:
                validation(s)
        s.phase("optimizer", 1)
    return s


def test_evaluation_inside_an_accumulation_window_is_outside_time_not_the_step():
    """Validation every N micro-batches (Lightning's val_check_interval) lands between two micro-batches of one
    step: its fetches and no-grad forwards are outside time, not the step's samples, phases or duration."""
    tracker = StepTracker()
    steps = _validated_mid_window(lambda s: [s.phase("data", 2, 72).nograd_forward(5) for _ in range(20)]).run(tracker)
    assert len(steps) == 3
    assert [r.samples for r in steps] == [16, 16, 16]
    inside = steps[1]
    assert inside.duration == pytest.approx(0.007) and inside.other == pytest.approx(0.0, abs=1e-9)
    assert inside.phases == pytest.approx({"data": 0.002, "forward": 0.002, "backward": 0.002, "optimizer": 0.001})
    assert tracker.outside["evaluation"] == pytest.approx(20 * 0.007)


def test_a_checkpoint_after_validation_between_micro_batches_is_outside_checkpoint_time():
    """Validation lands between two micro-batches, ends with the val loader's exhausted fetch, then a checkpoint
    (Lightning's ModelCheckpoint): both outside, as between steps; the step is its training's 7 ms."""
    def validate_then_save(s: Seq) -> None:
        for _ in range(5):
            s.phase("data", 2, 72).nograd_forward(5)
        s.phase("data", 3, False).phase("checkpoint", 50)

    tracker = StepTracker()
    steps = _validated_mid_window(validate_then_save).run(tracker)
    assert len(steps) == 3 and steps[1].duration == pytest.approx(0.007) and steps[1].samples == 16
    assert tracker.outside["checkpoint"] == pytest.approx(0.050)
    assert tracker.outside["evaluation"] == pytest.approx(5 * 0.007 + 0.003)


@pytest.mark.parametrize("micro_batches", [1, 4])
@pytest.mark.parametrize("reference", ["trained model", "copy"])
def test_a_no_grad_pass_on_each_batch_before_the_training_forward_is_the_steps(micro_batches, reference):
    """DPO's reference pass (the trained model itself under no_grad, TRL with PEFT) or a momentum copy's (BYOL,
    MoCo: another instance of the model's class) on each batch, right before the training forward: the step's
    forward and samples, not an evaluation (the samples were dropped)."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(3):
        for _ in range(micro_batches):
            s.phase("data", 1, 8)
            if reference == "copy":
                s.forward(2, "ema", kind=COPY)
            else:
                s.nograd_forward(2)
            s.forward(3).phase("backward", 6)
        s.phase("optimizer", 1)
    steps = s.run(tracker)
    assert [r.samples for r in steps] == [8 * micro_batches] * 3
    assert all(r.phases["forward"] == pytest.approx(0.005 * micro_batches) for r in steps[1:])
    assert sum(tracker.outside.values()) == pytest.approx(0.0)


def test_an_evaluation_after_the_last_backward_of_a_run_that_ends_mid_window_is_outside_time():
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(2):
        s.phase("data", 1, 8).forward(1).phase("backward", 1).phase("optimizer", 1)
    s.phase("data", 1, 8).forward(1).phase("backward", 1)
    for _ in range(4):
        s.phase("data", 2, 72).nograd_forward(5)
    assert len(s.run(tracker)) == 2
    assert tracker.outside["evaluation"] == pytest.approx(4 * 0.007)


def test_a_frozen_teachers_forward_in_every_micro_batch_stays_in_the_step():
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(3):
        for _ in range(2):
            s.phase("data", 1, 8).nograd_forward(3, "teacher").forward(2, "student").phase("backward", 1)
        s.phase("optimizer", 1)
    tracker = StepTracker()
    steps = s.run(tracker)
    assert len(steps) == 3 and all(r.samples == 16 for r in steps)
    assert all(r.phases["forward"] == pytest.approx(0.010) for r in steps)
    assert sum(tracker.outside.values()) == 0


def test_evaluation_in_eval_mode_without_no_grad_is_outside_time():
    """``model.eval()`` then the validation batches with grad enabled (no ``torch.no_grad()``): the forwards are
    an evaluation all the same, not the next step's (it held every validation batch and its samples)."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for i in range(6):
        s.phase("data", 1, 8).forward(2).phase("backward", 3).phase("optimizer", 1)
        if i == 2:
            for _ in range(10):
                s.phase("data", 2, 72).forward(5, kind=EVALGRAD)
    steps = s.run(tracker)
    assert len(steps) == 6 and all(r.samples == 8 for r in steps)
    assert steps[3].duration == pytest.approx(0.007)
    assert tracker.outside["evaluation"] == pytest.approx(10 * 0.007)


@pytest.mark.parametrize("loader", [True, False], ids=["loader", "tensors"])
def test_an_evaluation_without_no_grad_through_a_loss_with_parameters_is_outside_time(loader):
    """``model.eval()`` leaves a loss module with parameters of its own (a center loss, an ArcFace margin: a root,
    trained with the model) in train mode: its call with grad after the evaluated model's is the evaluation's, not
    the start of the next step (which then held every validation batch)."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for i in range(6):
        if loader:
            s.phase("data", 1, 8)
        s.forward(2).forward(1, "loss").phase("backward", 3).phase("optimizer", 1)
        if i == 2:
            for _ in range(10):
                if loader:
                    s.phase("data", 2, 72)
                s.forward(5, kind=EVALGRAD).forward(1, "loss")
    steps = s.run(tracker)
    assert len(steps) == 6 and all(r.samples == (8 if loader else None) for r in steps)
    assert steps[3].duration == pytest.approx(0.007 + 0.001 * loader)
    assert tracker.outside["evaluation"] == pytest.approx(10 * (0.006 + 0.002 * loader))


def test_a_loop_that_trains_in_eval_mode_is_counted_as_any_loop():
    """A script that called ``model.eval()`` and forgot ``model.train()`` trains with every forward in eval mode:
    a backward follows each, so they are the steps' forwards, not evaluations."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(5):
        s.phase("data", 1, 8).forward(2, kind=EVALGRAD).phase("backward", 3).phase("optimizer", 1)
    steps = s.run(tracker)
    assert len(steps) == 5 and all(r.samples == 8 for r in steps)
    assert all(r.phases["forward"] == pytest.approx(0.002) for r in steps)
    assert sum(tracker.outside.values()) == 0


def test_a_teacher_in_eval_mode_called_with_grad_stays_in_the_step():
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(4):
        s.phase("data", 1, 8).forward(3, "teacher", kind=EVALGRAD).forward(2, "student").phase("backward", 2)
        s.phase("optimizer", 1)
    tracker = StepTracker()
    steps = s.run(tracker)
    assert len(steps) == 4 and all(r.phases["forward"] == pytest.approx(0.005) for r in steps)
    assert sum(tracker.outside.values()) == 0


def test_ema_copy_evaluated_without_loader_is_outside_time():
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for i in range(4):
        s.forward(2).phase("backward", 3).phase("optimizer", 1)
        if i == 1:
            for _ in range(10):
                s.forward(4, "ema", kind=COPY)
    steps = s.run(tracker)
    assert len(steps) == 4
    assert steps[2].duration == pytest.approx(0.006)
    assert tracker.outside["evaluation"] == pytest.approx(0.040)


def test_evaluation_before_training_without_loader_is_outside():
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(100):  # more than any old call limit
        s.nograd_forward(1)
    for _ in range(3):
        s.forward(2).phase("backward", 2).phase("optimizer", 1)
    steps = s.run(tracker)
    assert len(steps) == 3
    assert steps[0].duration == pytest.approx(0.005)
    assert tracker.outside["evaluation"] == pytest.approx(0.100)


def test_checkpoint_between_steps_is_outside_checkpoint_time():
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for i in range(4):
        s.phase("data", 1, 8).forward(2).phase("backward", 2).phase("optimizer", 1)
        if i == 1:
            s.phase("checkpoint", 30)
    steps = s.run(tracker)
    assert len(steps) == 4
    assert steps[2].duration == pytest.approx(0.006)
    assert tracker.outside["checkpoint"] == pytest.approx(0.030)
    assert tracker.outside["evaluation"] == 0


@pytest.mark.parametrize("first", [True, False])
def test_a_save_before_an_iteration_without_a_loader_is_outside_checkpoint_time(first):
    """A loop without a DataLoader begins its iterations at the forward: a ``torch.save`` before it (before the
    first step, or at the top of the loop body) is checkpoint time outside steps, not the step's other. What the
    loop does between the save and the forward (building the batch) stays the step's, as in every other step."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for i in range(4):
        s.gap(40)  # the loop's own work before its forward, every iteration
        if i == (0 if first else 2):
            s.phase("checkpoint", 30)
            s.gap(40)
        s.forward(2).phase("backward", 2).phase("optimizer", 1)
    steps = s.run(tracker)
    # step 1 begins at the first thing perfmon sees: the save (ending it), else the forward (its 40 ms before, unseen)
    expected = [0.045] * 4 if first else [0.005, 0.045, 0.045, 0.045]
    assert [round(r.duration, 6) for r in steps] == expected
    assert tracker.outside["checkpoint"] == pytest.approx(0.030)
    assert tracker.outside["other"] == pytest.approx(0.0 if first else 0.040)  # before the save: between steps


def test_final_evaluation_after_the_last_step_is_counted_at_finish():
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(2):
        s.phase("data", 1, 8).forward(2).phase("backward", 2).phase("optimizer", 1)
    for _ in range(3):
        s.phase("data", 1, 64).nograd_forward(3)
    assert len(s.run(tracker)) == 2
    assert tracker.outside["evaluation"] == pytest.approx(0.012)


def test_an_epochs_end_is_not_evaluation():
    """The fetch that finds the loader done (StopIteration; a multi-worker loader shuts its workers down in it) is
    the data of the next epoch's first step, or "other" after the last step: a loop with epochs and no evaluation
    showed "evaluation" time."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(2):
        for _ in range(3):
            s.phase("data", 1, 8).forward(2).phase("backward", 2).phase("optimizer", 1)
        s.phase("data", 4, False)  # ("data", False): the fetch raised
    steps = s.run(tracker)
    finished = tracker.finish()
    assert finished is None and len(steps) == 6
    assert steps[3].phases["data"] == pytest.approx(0.005)  # the epoch's turn is the next step's data
    assert tracker.outside["evaluation"] == 0 and tracker.outside["other"] == pytest.approx(0.004)


def test_validation_after_an_epochs_end_is_still_evaluation():
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for i in range(4):
        s.phase("data", 1, 8).forward(2).phase("backward", 2).phase("optimizer", 1)
        if i == 1:
            s.phase("data", 4, False)
            for _ in range(3):
                s.phase("data", 2, 64).nograd_forward(3)
    assert len(s.run(tracker)) == 4
    # the epoch's end before the validation is "other"
    assert tracker.outside["evaluation"] == pytest.approx(3 * 0.005)
    assert tracker.outside["other"] == pytest.approx(0.004)


@pytest.mark.parametrize("zipped", [1, 2], ids=["one-loader", "two-loaders-zipped"])
@pytest.mark.parametrize("val_end", [False, True], ids=["", "val-loader-ends"])
@pytest.mark.parametrize("compiled", [False, True], ids=["", "whole-step-compiled"])
def test_an_evaluation_that_calls_no_trained_module_is_outside_the_next_step(zipped, val_end, compiled):
    """A probe between epochs that fetches its own loader's batches and gives them to a submodule (MoCo's kNN
    monitor calls ``model.encoder_q``, SimSiam's ``model.backbone``) or to no module at all: no forward perfmon
    times, only fetches. Those beyond what the loop's steps fetch are an evaluation's, outside the steps; the
    next step keeps its own fetches (and the training loader's end) and its own samples. So too where a compiled
    function holds the whole step (``@torch.compile def train_step``): no forward is timed at all there."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for epoch in range(3):
        for _ in range(zipped):
            s.phase("data", 3, arg=NEW_EPOCH_BEGINS)  # iter(loader): its workers start
        for _ in range(4):
            for _ in range(zipped):
                s.phase("data", 1, 8)
            (s.gap(2) if compiled else s.forward(2)).phase("backward", 2).phase("optimizer", 1)
        s.phase("data", 4, False)  # the training loader's end
        if epoch < 2:
            s.phase("data", 3, arg=NEW_EVAL_EPOCH_BEGINS)  # under no_grad (or the model in eval mode)
            for _ in range(5):
                s.phase("data", 2, 100).gap(3)  # model.encoder(x) under no_grad: not timed
            if val_end:
                s.phase("data", 1, False)
    steps = s.run(tracker)
    assert tracker.finish() is None and len(steps) == 12
    assert [r.samples for r in steps] == [8 * zipped] * 12
    # an epoch's first step: its loaders' new epochs and its own fetches
    first = steps[4].phases["data"], steps[8].phases["data"]
    assert first == (pytest.approx(0.004 * zipped), pytest.approx(0.004 * zipped))
    # the probe (its loader's start, its batches, its end); the training loader's end before it, and the last
    # epoch's, are "other"
    assert tracker.outside["evaluation"] == pytest.approx(2 * (0.003 + 5 * 0.005 + 0.001 * val_end))
    assert tracker.outside["other"] == pytest.approx(3 * 0.004)


@pytest.mark.parametrize("epoch_end", [False, True], ids=["mid-epoch", "at-the-epochs-last-batch"])
def test_an_evaluation_loaders_end_is_the_evaluations_not_the_next_steps_data(epoch_end):
    """Validation every 4 steps through a loader with workers: the fetch that finds it done shuts its workers down
    (tens of ms). That is the evaluation's, not the next step's data (the step after each evaluation read 59-112 ms
    of data against 0.3, and a false critical input-bound said 34% of each step waited for data). Where the
    validation ran after the epoch's last batch, the training loader's end comes too: the step's data is still
    only its loader's new epoch and its batch."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for i in range(12):
        s.phase("data", 1, 16).forward(2).phase("backward", 2).phase("optimizer", 1)
        if i % 4 == 3 and i < 11:
            s.phase("data", 30, arg=NEW_EVAL_EPOCH_BEGINS)  # its workers start
            for _ in range(4):
                s.phase("data", 2, 64).nograd_forward(5)
            s.phase("data", 60, False)  # its workers shut down
            if epoch_end:
                s.phase("data", 4, False).phase("data", 20, arg=NEW_EPOCH_BEGINS)
    steps = s.run(tracker)
    assert tracker.finish() is None and len(steps) == 12
    assert [r.samples for r in steps] == [16] * 12
    after = 0.001 + (0.020 if epoch_end else 0)
    assert [r.phases["data"] for r in steps] == [pytest.approx(after if i in (4, 8) else 0.001) for i in range(12)]
    assert tracker.outside["evaluation"] == pytest.approx(2 * (0.030 + 4 * 0.007 + 0.060 + 0.004 * epoch_end))


@pytest.mark.parametrize("final_eval", [False, True], ids=["writes", "test-set-then-writes"])
def test_what_runs_after_the_last_step_until_the_job_ends_is_outside_time(final_eval):
    """The script's end after its last step (a final test-set evaluation, then writing results for a second) is
    outside time: it was in no figure at all (1 s after the last save read "outside other 0")."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(4):
        s.phase("data", 1, 8).forward(2).phase("backward", 2).phase("optimizer", 1)
    s.gap(10)
    if final_eval:
        for _ in range(3):
            s.phase("data", 2, 64).nograd_forward(5)
    s.phase("checkpoint", 30)
    steps = s.run(tracker, end=s.t + 1.0)  # a second of writes after the last event
    assert len(steps) == 4
    assert tracker.outside["checkpoint"] == pytest.approx(0.030)
    if final_eval:  # from the evaluation's first fetch to the job's end; the 10 ms before it is other
        assert tracker.outside["evaluation"] == pytest.approx(3 * 0.007 + 1.0)
        assert tracker.outside["other"] == pytest.approx(0.010)
    else:
        assert tracker.outside["other"] == pytest.approx(0.010 + 1.0) and tracker.outside["evaluation"] == 0


def test_a_batch_an_evaluation_broke_off_at_is_the_evaluations_not_the_next_epochs_first_step():
    """``for i, batch in enumerate(val_loader): if i == 3: break`` with no_grad only around each pass: the fourth
    batch, fetched and left, and what ran after it (the epoch's writes, 300 ms) were the next epoch's first step
    (its samples 96 of 32, the writes its *other*). The training loader's new epoch begins that step."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for epoch in range(3):
        s.phase("data", 5, arg=NEW_EPOCH_BEGINS)
        for _ in range(4):
            s.phase("data", 1, 32).forward(2).phase("backward", 2).phase("optimizer", 1)
        s.phase("data", 2, False)  # the training loader's end
        if epoch < 2:
            s.phase("data", 20, arg=NEW_EPOCH_BEGINS)  # the validation's loader, iterated with grad enabled
            for _ in range(3):
                s.phase("data", 2, 32).nograd_forward(5)
            s.phase("data", 2, 32).gap(300)  # fetched, then break; the epoch's writes
    steps = s.run(tracker)
    assert tracker.finish() is None and len(steps) == 12
    assert [r.samples for r in steps] == [32] * 12
    assert [r.other for r in steps] == [pytest.approx(0)] * 12
    assert steps[4].phases["data"] == pytest.approx(0.006)
    assert tracker.outside["evaluation"] == pytest.approx(2 * (0.020 + 3 * 0.007 + 0.302))
    assert tracker.outside["other"] == pytest.approx(3 * 0.002)


def test_an_evaluation_loader_iterated_with_grad_enabled_is_evaluation_from_its_new_epoch():
    """HF Trainer's evaluation_loop iterates its loader with grad enabled (no_grad only in prediction_step), so its
    new epoch (its workers' start: 8-15% of each evaluation) reads as a training loader's; outside the steps, with
    its batches and no-grad passes after it, it is the evaluation's, not *other*."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for i in range(8):
        s.phase("data", 1, 16).forward(2).phase("backward", 2).phase("optimizer", 1)
        if i in (3, 7):
            s.phase("data", 40, arg=NEW_EPOCH_BEGINS)
            for _ in range(3):
                s.phase("data", 2, 64).nograd_forward(5)
            s.phase("data", 10, False)
    steps = s.run(tracker)
    assert tracker.finish() is None and len(steps) == 8
    assert [r.samples for r in steps] == [16] * 8 and steps[4].phases["data"] == pytest.approx(0.001)
    assert tracker.outside["evaluation"] == pytest.approx(2 * (0.040 + 3 * 0.007 + 0.010))
    assert tracker.outside["other"] == 0


@pytest.mark.parametrize("zipped", [1, 2], ids=["one-loader", "two-loaders-zipped"])
def test_a_loaders_new_epoch_is_the_next_steps_data_never_evaluation(zipped):
    """``iter(loader)`` at each epoch (a loader without persistent workers starts them there: seconds) is the data
    of the epoch's first step, with the last epoch's end; it is no batch of another loop (19% of a plain epoch
    loop with two workers read as evaluation)."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(3):
        for _ in range(zipped):
            s.phase("data", 30, arg=NEW_EPOCH_BEGINS)
        for _ in range(4):
            for _ in range(zipped):
                s.phase("data", 1, 8)
            s.forward(2).phase("backward", 2).phase("optimizer", 1)
        s.phase("data", 4, False)
    steps = s.run(tracker)
    assert tracker.finish() is None and len(steps) == 12
    assert [r.samples for r in steps] == [8 * zipped] * 12
    assert steps[4].phases["data"] == steps[8].phases["data"] == pytest.approx(0.004 + 0.031 * zipped)
    assert tracker.outside["evaluation"] == 0 and tracker.outside["other"] == pytest.approx(0.004)


@pytest.mark.parametrize("loaders", [2, 3])
@pytest.mark.parametrize("evaluate", [False, True], ids=["", "evaluation-after-each-epoch"])
def test_a_zipped_loaders_batch_abandoned_at_an_epochs_end_is_not_evaluation(loaders, evaluate):
    """``for (xs, ys), (xt, _) in zip(source, target)`` (domain adaptation) with the target loader the shorter: at
    the epoch's end zip fetches one more source batch before the target's fetch finds its loader done, and drops
    it. That batch belongs to no evaluation: one ran without any evaluation read 40 ms of "evaluation" at the run's
    end, and each evaluation began 12-18 ms early."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(3):
        for _ in range(loaders):
            s.phase("data", 3, arg=NEW_EPOCH_BEGINS)
        for _ in range(4):
            for _ in range(loaders):
                s.phase("data", 1, 8)
            s.forward(2).phase("backward", 2).phase("optimizer", 1)
        for _ in range(loaders - 1):
            s.phase("data", 10, 8)  # the longer loaders' batches, fetched and dropped
        s.phase("data", 1, False)  # the shortest loader is done
        if evaluate:
            s.phase("data", 2, arg=NEW_EVAL_EPOCH_BEGINS)
            for _ in range(3):
                s.phase("data", 2, 20).nograd_forward(3)
            s.phase("data", 1, False)
    steps = s.run(tracker, end=None)
    assert tracker.finish() is None and len(steps) == 12
    evaluation = 2 + 3 * 5 + 1
    assert tracker.outside["evaluation"] == pytest.approx(3 * evaluation / 1000 if evaluate else 0)
    dropped = (loaders - 1) * 10 + 1
    if evaluate:  # each epoch's end is "other"
        assert tracker.outside["other"] == pytest.approx(3 * dropped / 1000)
    else:  # the next epoch's first step fetched it; the last one is "other"
        assert steps[4].phases["data"] == pytest.approx((dropped + loaders * 4) / 1000)
        assert tracker.outside["other"] == pytest.approx(dropped / 1000)


@pytest.mark.parametrize("probe", [False, True], ids=["", "probe-between-epochs"])
def test_a_loader_that_fetches_ahead_keeps_every_batch_in_the_steps(probe):
    """accelerate's prepared DataLoader fetches one batch ahead: an epoch's first step fetches two (its own and
    the next), its last none (the fetch ahead finds the loader done before it trains). Those two follow a training
    loader's new epoch: both the step's, not one another loop's (every epoch after the first lost a batch to
    "evaluation"). A probe between the epochs (its loader iterated under no_grad) is still evaluation."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for epoch in range(3):
        s.phase("data", 2, arg=NEW_EPOCH_BEGINS).phase("data", 1, 8)
        for i in range(4):
            s.phase("data", 1, 8 if i < 3 else False)  # the batch ahead; the last finds the loader done
            s.forward(2).phase("backward", 2).phase("optimizer", 1)
        if probe and epoch < 2:
            s.phase("data", 3, arg=NEW_EVAL_EPOCH_BEGINS)
            for _ in range(5):
                s.phase("data", 2, 100).gap(3)
            s.phase("data", 1, False)
    steps = s.run(tracker)
    assert tracker.finish() is None and len(steps) == 12
    assert sum(r.samples or 0 for r in steps) == 3 * 4 * 8
    assert [r.samples for r in steps][:5] == [16, 8, 8, None, 16]
    assert steps[4].phases["data"] == pytest.approx(0.004)
    assert tracker.outside["evaluation"] == pytest.approx(2 * (0.003 + 5 * 0.005 + 0.001) if probe else 0)


def test_an_update_after_the_step_before_acting_is_other_not_evaluation():
    """Reinforcement learning without a DataLoader: a Polyak (soft) update of the target networks after the
    optimizer step, then acting with the trained policy under no_grad until the next update. The acting is
    evaluation (a no-grad pass of the trained model); the update before it is not (it read as evaluation too)."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(4):
        s.forward(2).phase("backward", 2).phase("optimizer", 1).gap(5)  # the soft update: no module call
        for _ in range(3):
            s.nograd_forward(1).gap(2)  # acting, then the environment's step
    steps = s.run(tracker)
    assert len(steps) == 4
    tracker.finish()  # the last update's acting too
    assert tracker.outside["other"] == pytest.approx(4 * 0.005)
    assert tracker.outside["evaluation"] == pytest.approx(4 * 3 * 0.003 - 0.002)  # to its last event


def test_an_epochs_end_before_a_zipped_step_stays_its_data():
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(2):
        for _ in range(3):
            s.phase("data", 1, 8).phase("data", 1, 8).forward(2).phase("backward", 2).phase("optimizer", 1)
        s.phase("data", 4, False)
    steps = s.run(tracker)
    assert len(steps) == 6 and steps[3].phases["data"] == pytest.approx(0.006)
    assert tracker.outside["evaluation"] == 0


def test_two_loaders_zipped_are_one_fetch_of_the_step():
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(3):
        s.phase("data", 1, 8).phase("data", 1, 8).forward(2).phase("backward", 2).phase("optimizer", 1)
    steps = s.run()
    assert len(steps) == 3
    assert all(r.samples == 16 and r.phases["data"] == pytest.approx(0.002) for r in steps)


def test_instrument_after_the_optimizer_exists_counts_one_step_per_update():
    # no OPTIMIZER_CREATED: the agent started after the optimizer was built and found none
    s = Seq()
    for _ in range(5):
        s.forward(1).phase("backward", 1).phase("optimizer", 1)
    assert len(s.run()) == 5


def test_boundaries_commit_once_per_iteration_for_commands():
    """The training thread's commits (which start/stop profiler windows) match the steps."""
    bounds = Boundaries()
    bounds.optimizers_seen = True
    commits = 0
    for _ in range(6):
        for phase, key in (("data", None), ("forward", None), ("backward", None), ("optimizer", "D"),
                           ("forward", None), ("backward", None), ("optimizer", "G")):
            commits += bounds.begin(phase, key)
            commits += bounds.end(phase, key)
    assert commits == 5  # the 6th is committed by the next iteration (or the job's end)


def test_single_optimizer_steps_end_at_the_update_once_the_loop_is_known():
    """One optimizer: from the second step on, the step ends at its update (a stalled loop still shows it)."""
    bounds = Boundaries()
    bounds.optimizers_seen = True
    at_end = []
    for _ in range(4):
        for phase, key in (("data", None), ("forward", GRAD), ("backward", None), ("optimizer", "opt")):
            bounds.begin(phase, key)
            at_end.append(bounds.end(phase, key))
    assert at_end[3::4] == [False, True, True, True]  # the first waits for the next fetch to learn the loop


def test_end_boundary_is_end_then_boundary():
    """The hooks send one END_BOUNDARY event where a phase's end also ends the step."""
    from perfmon.agent.steps import END_BOUNDARY

    def events(merged: bool) -> list[tuple[int, float, object]]:
        out: list[tuple[int, float, object]] = [(OPTIMIZER_CREATED, 0.0, None)]
        t = 0.0
        for _ in range(3):
            for phase, ms in (("forward", 2), ("backward", 3), ("optimizer", 1)):
                out.append((BEGIN, t, phase))
                t += ms / 1000
                arg = ("optimizer", "opt") if phase == "optimizer" else phase
                if phase == "optimizer" and merged:
                    out.append((END_BOUNDARY, t, arg))
                else:
                    out.append((END, t, arg))
                    if phase == "optimizer":
                        out.append((BOUNDARY, t, None))
            t += 0.5 / 1000
        return out

    def records(evs):
        tracker = StepTracker()
        return [(r.index, r.start, r.end, r.phases) for e in evs if (r := tracker.feed(*e)) is not None]

    merged = records(events(True))
    assert len(merged) == 3 and merged == records(events(False))
    assert merged[1][3]["backward"] == pytest.approx(0.003)


# -- feed_many: the agent's batched path (a fast path for steady loops) equals feeding one by one ---------------


def hook_stream(s: Seq) -> list[tuple[int, float, object, object]]:
    """The events the agent's buffer holds for ``s``: what the hooks append, Boundaries deciding (a BOUNDARY
    before a phase that ends the previous step, END_BOUNDARY where a phase's end ends it), no CUDA marks."""
    from perfmon.agent.steps import END_BOUNDARY

    bounds = Boundaries()
    out: list[tuple[int, float, object, object]] = []
    for code, t, arg, key in s.events:
        if code == BEGIN:
            if bounds.begin(arg[0] if isinstance(arg, tuple) else arg, key):
                out.append((BOUNDARY, t, None, None))
        elif code == END:
            ended = bounds.end(arg[0] if isinstance(arg, tuple) else arg, key)
            out.append((END_BOUNDARY if ended else END, t, arg, None))
            continue
        elif code == STEP:
            bounds.explicit = True
        elif code == OPTIMIZER_CREATED:
            bounds.optimizers_seen = True
        out.append((code, t, arg, None))
    return out


def _facts(tracker: StepTracker, records: list) -> list:
    final = tracker.finish()
    return [(r.index, r.start, r.end, dict(r.phases), r.samples, r.closures, dict(r.marks))
            for r in [*records, *([final] if final else [])]] + [tracker.count, tracker.drain_outside()]


def one_by_one(events: list) -> list:
    tracker = StepTracker()
    return _facts(tracker, [r for e in events if (r := tracker.feed(*e)) is not None])


def batched(events: list, seed: int) -> tuple[list, int]:
    """feed_many over chunks of random sizes (the agent's ticks cut the stream anywhere); also the steps that
    took the fast path."""
    import random

    rng = random.Random(seed)
    tracker, records, i = StepTracker(), [], 0
    while i < len(events):
        n = rng.choice((1, 2, 3, 5, 7, 8, 13, 50, 400))
        records += tracker.feed_many(events[i : i + n])
        i += n
    return _facts(tracker, records), tracker.fast_steps


def _steady(s: Seq, steps: int, loader: bool) -> Seq:
    for _ in range(steps):
        if loader:
            s.phase("data", 1, 16)
        s.forward(2).gap(0.3).phase("backward", 3).phase("optimizer", 1).gap(0.2)
    return s


def _mixed(seed: int) -> Seq:
    """Steady stretches broken by every irregular thing a real loop does between or inside its steps."""
    import random

    rng = random.Random(seed)
    s = Seq().mark(OPTIMIZER_CREATED)
    loader = rng.random() < 0.5
    for _ in range(40):
        kind = rng.choice(("steady", "steady", "steady", "eval", "ckpt", "closure", "scaler", "teacher", "accum",
                           "nosamples", "copy", "accum-eval", "eval-with-grad", "eval-mode-training"))
        if kind == "steady":
            _steady(s, rng.randint(1, 12), loader)
        elif kind == "eval":
            for _ in range(rng.randint(1, 3)):
                if loader:
                    s.phase("data", 1, 8)
                s.nograd_forward(1)
        elif kind == "ckpt":
            s.phase("checkpoint", 2)
        elif kind == "closure":  # LBFGS: forward and backward inside the optimizer
            s.phase("data", 1, 4).phase("optimizer", 3, inner=[("forward", 1), ("backward", 1)])
        elif kind == "scaler":
            s.phase("data", 1, 4).forward(1).phase("backward", 1).phase("optimizer", 1, inner=[("optimizer", 1)])
        elif kind == "teacher":
            s.phase("data", 1, 8).nograd_forward(2, "teacher").forward(1).phase("backward", 1).phase("optimizer", 1)
        elif kind == "accum":
            for _ in range(2):
                s.phase("data", 1, 8).forward(1).phase("backward", 1)
            s.phase("optimizer", 1)
        elif kind == "accum-eval":  # validation between two micro-batches of one step
            s.phase("data", 1, 8).forward(1).phase("backward", 1)
            for _ in range(rng.randint(1, 3)):
                if loader:
                    s.phase("data", 1, 8)
                s.nograd_forward(1)
            s.phase("data", 1, 8).forward(1).phase("backward", 1).phase("optimizer", 1)
        elif kind == "eval-with-grad":  # model.eval() without torch.no_grad()
            for _ in range(rng.randint(1, 3)):
                if loader:
                    s.phase("data", 1, 8)
                s.forward(1, kind=EVALGRAD)
        elif kind == "eval-mode-training":  # it forgot model.train()
            s.phase("data", 1, 8).forward(1, kind=EVALGRAD).phase("backward", 1).phase("optimizer", 1)
        elif kind == "nosamples":
            s.phase("data", 1, None).forward(1).phase("backward", 1).phase("optimizer", 1)
        else:  # an EMA copy evaluated between steps
            s.forward(1, "ema", kind=COPY)
        s.gap(rng.random())
    return s


CASES = {
    "dataloader": lambda: _steady(Seq().mark(OPTIMIZER_CREATED), 60, True),
    "no-dataloader": lambda: _steady(Seq().mark(OPTIMIZER_CREATED), 60, False),
    "no OPTIMIZER_CREATED": lambda: _steady(Seq(), 30, True),
    "gan": lambda: [gan_batch(s, True) for s in [Seq().mark(OPTIMIZER_CREATED)] for _ in range(20)][0],
    "manual updates": lambda: [s.forward(1).phase("backward", 1).gap(1) for s in [Seq()] for _ in range(20)][0],
    "explicit step()": lambda: [_steady(s, 1, True).mark(STEP) for s in [_steady(Seq().mark(OPTIMIZER_CREATED), 10,
                                                                                   True)] for _ in range(10)][0],
    **{f"mixed-{seed}": (lambda seed=seed: _mixed(seed)) for seed in range(12)},
}


@pytest.mark.parametrize("case", list(CASES))
def test_feed_many_equals_feeding_one_by_one(case):
    events = hook_stream(CASES[case]())
    expected = one_by_one(events)
    for seed in range(4):
        got, _ = batched(events, seed)
        assert got == expected


def test_feed_many_takes_the_fast_path_on_steady_loops_only():
    for loader in (True, False):
        events = hook_stream(_steady(Seq().mark(OPTIMIZER_CREATED), 200, loader))
        got, fast = batched(events, 0)
        assert got == one_by_one(events)
        assert fast >= 150  # not the first steps, nor those a chunk's edge cut in two
        whole = StepTracker()
        assert len(whole.feed_many(events)) == 200 and whole.fast_steps >= 198  # the first steps teach the loop
    gan = hook_stream(CASES["gan"]())
    assert batched(gan, 0)[1] == 0  # two optimizers: every step goes the general way
    mixed = hook_stream(_mixed(3))
    assert 0 < batched(mixed, 0)[1] < len([e for e in mixed if e[0] == BEGIN and e[2] == "optimizer"])


# -- the fetch rules: loops they must not break ---------------------------------------------------------------
def _validation(s: Seq) -> None:
    """A validation between epochs: its loader's epoch under no_grad, three batches and passes, its loader's end."""
    s.phase("data", 3, arg=NEW_EVAL_EPOCH_BEGINS)
    for _ in range(3):
        s.phase("data", 1, 8).nograd_forward(2)
    s.phase("data", 1, False)


@pytest.mark.parametrize("why", ["teacher-in-eval-mode", "model.train()-in-training_step"])
def test_fetch_ahead_loader_whose_epoch_began_with_some_root_in_eval_mode_keeps_its_batches(why):
    """accelerate's loader fetches one batch ahead, in an epoch that began with a root in eval mode (a frozen teacher,
    DPO's reference model; HF's Trainer calls model.train() inside training_step, so the epoch after evaluate()
    begins in eval mode): with grad enabled it is a training loader's epoch, and no batch of it is lost."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for epoch in range(3):
        s.phase("data", 2, arg=NEW_EPOCH_BEGINS).phase("data", 1, 8)
        for i in range(4):
            s.phase("data", 1, 8 if i < 3 else False)
            if why == "teacher-in-eval-mode":
                s.nograd_forward(1, "teacher")
            s.forward(2).phase("backward", 2).phase("optimizer", 1)
        if why != "teacher-in-eval-mode" and epoch < 2:  # Trainer.evaluate(): model.eval(), its own loader
            _validation(s)
    steps = s.run(tracker)
    assert len(steps) == 12
    assert sum(r.samples or 0 for r in steps) == 3 * 4 * 8
    expected_eval = 0 if why == "teacher-in-eval-mode" else 2 * (0.003 + 3 * 0.003 + 0.001)  # with its loader's end
    assert tracker.outside["evaluation"] == pytest.approx(expected_eval)



def test_a_skipped_batch_is_no_evaluation():
    """`for batch in loader: if bad(batch): continue` (a collate that drops corrupt samples, a length filter): the
    step after a skipped batch fetched two; the first is no evaluation's fetch (it was read as one)."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for i in range(6):
        if i == 3:
            s.phase("data", 5, 8)  # skipped: `continue`
        s.phase("data", 1, 8).forward(2).phase("backward", 2).phase("optimizer", 1)
    steps = s.run(tracker)
    assert len(steps) == 6
    assert tracker.outside["evaluation"] == 0
    assert steps[3].phases["data"] == pytest.approx(0.006)


def test_a_token_budget_batcher_that_fetches_more_than_last_step_keeps_its_fetches():
    """A loop that fills each step up to a token budget (`while tokens < budget: batch = next(it)`): a step that
    fetches more than the one before keeps them all (they were read as evaluation, their samples lost)."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for n in [2, 2, 3, 2, 4, 3]:
        for _ in range(n):
            s.phase("data", 1, 8)
        s.forward(2).phase("backward", 2).phase("optimizer", 1)
    steps = s.run(tracker)
    assert [r.samples for r in steps] == [16, 16, 24, 16, 32, 24]
    assert tracker.outside["evaluation"] == 0



def test_zip_of_two_fetch_ahead_loaders_of_different_lengths_keeps_the_next_epochs_batches():
    """Two accelerate-prepared loaders zipped (semi-supervised with accelerate), A shorter than B. At A's last step
    A's fetch ahead finds A done while B fetches a batch: that step fetched ONE batch, and _fetches becomes 1 (an
    epoch's end is not what the loop's steps fetch). The next epoch's first step fetches two of A and two of B after
    their new epochs; both loaders' batches are the step's (A's two became 'evaluation')."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(3):
        s.phase("data", 2, arg=NEW_EPOCH_BEGINS).phase("data", 1, 8).phase("data", 1, 8)  # A: open, its 1st, ahead
        s.phase("data", 2, arg=NEW_EPOCH_BEGINS).phase("data", 1, 8).phase("data", 1, 8)  # B: the same
        s.forward(2).phase("backward", 2).phase("optimizer", 1)
        for i in range(3):  # A has 4 batches, B more
            s.phase("data", 1, 8 if i < 2 else False).phase("data", 1, 8)
            s.forward(2).phase("backward", 2).phase("optimizer", 1)
        # zip asks A again: A's generator is done (no fetch event): the epoch ends
    steps = s.run(tracker)
    assert len(steps) == 12
    assert [r.samples for r in steps][:8] == [32, 16, 16, 8] * 2
    assert tracker.outside["evaluation"] == 0


def test_feed_many_learns_the_same_fetches_as_feeding_one_by_one():
    """The Python fast path (_steady) takes a step led by a fetch that found the loader done (accelerate's last
    step of an epoch: ("data", False), then the training) as no batch, as feed() does: both learn the same count.
    Here an epoch of two batches through a fetch-ahead loader (first step: 2 fetches), then a batch of a probe
    whose iterator was made earlier, then the next loader's epoch: the same steps either way."""
    from test_steps import batched, hook_stream, one_by_one

    s = Seq().mark(OPTIMIZER_CREATED)
    s.phase("data", 2, arg=NEW_EPOCH_BEGINS).phase("data", 1, 8).phase("data", 1, 8)
    s.forward(2).phase("backward", 2).phase("optimizer", 1)
    s.phase("data", 1, False).forward(2).phase("backward", 2).phase("optimizer", 1)
    s.phase("data", 2, 100).gap(3)  # next(probe_iter): a probe batch, no timed forward
    s.phase("data", 2, arg=NEW_EPOCH_BEGINS)
    for _ in range(3):
        s.phase("data", 1, 8).forward(2).phase("backward", 2).phase("optimizer", 1)
    events = hook_stream(s)
    expected = one_by_one(events)
    got, fast = batched(events, 0)
    assert fast > 0
    assert got == expected


def test_a_generators_eval_samples_with_grad_before_a_discriminator_step_stay_evaluation():
    """A GAN over tensors (no DataLoader), DCGAN's order: D(real), backward, G(z), D(fake), backward, optD.step, then
    G's update. Every few steps it samples with G.eval() and forgets no_grad (EVALGRAD), then G.train(). The next
    step's D(real) (D in train mode, with grad) now reads as that evaluation's 'paired' loss module, and since a
    backward follows, the pairing is undone: G's sampling stays outside the step (it went into it)."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for i in range(6):
        s.forward(1, "D").phase("backward", 1).forward(1, "G").forward(1, "D").phase("backward", 1)
        s.phase("optimizer", 1, opt="optD")
        s.forward(1, "D").phase("backward", 1).phase("optimizer", 1, opt="optG")
        if i == 2:
            s.forward(20, "G", kind=EVALGRAD)  # G.eval(); samples = G(fixed_noise)  (no torch.no_grad())
    steps = s.run(tracker)
    assert len(steps) == 6
    assert tracker.outside["evaluation"] == pytest.approx(0.020)
    assert steps[3].phases["forward"] == pytest.approx(0.004)


def test_hf_trainer_with_accumulation_and_evaluation_each_epoch_keeps_every_batch():
    """HF Trainer: get_batch_samples fetches a step's gradient_accumulation_steps (4) micro-batches up front from
    accelerate's loader (one batch ahead), training_step calls model.train(), evaluation_loop model.eval(). With
    eval_strategy="epoch" each epoch after the first begins (iter(loader)) with the model in eval mode:
    NEW_EVAL_EPOCH. 10 batches an epoch: steps of 4, 4, 2 micro-batches; the epoch's last step fetched one batch
    (and the fetch that found the loader done), so _fetches == 1; the next epoch's first step keeps 1 of its 5
    fetches, and _fetches never grew back: every later step kept 1 of its 4. Every batch stays in its step."""
    tracker = StepTracker()
    s = Seq().mark(OPTIMIZER_CREATED)
    for epoch in range(3):
        s.phase("data", 2, arg=NEW_EPOCH_BEGINS)
        fetched = 0
        for n in (4, 4, 2):
            for _ in range(n + (fetched == 0)):  # the first next() fetches two
                fetched += 1
                s.phase("data", 1, 8 if fetched <= 10 else False)
            for _ in range(n):
                s.forward(2).phase("backward", 2)
            s.phase("optimizer", 1)
        if epoch < 2:  # Trainer.evaluate(): model.eval() under no_grad, its own (prepared) loader
            _validation(s)
    steps = s.run(tracker)
    assert len(steps) == 9
    assert [r.samples for r in steps] == [40, 32, 8] * 3
    assert tracker.outside["evaluation"] == pytest.approx(2 * 0.013)  # the validation, with its loader's end
