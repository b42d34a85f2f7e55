"""Step detection on synthetic hook-event sequences, one loop shape per case."""

from __future__ import annotations

import pytest

from perfmon.agent.steps import BEGIN, END, NOGRAD_FORWARD, OPTIMIZER_CREATED, STEP, StepTracker


class Seq:
    """Builds an event sequence with a fake clock: each phase takes the ms given."""

    def __init__(self) -> None:
        self.t = 0.0
        self.events: list[tuple[int, float, object]] = []

    def gap(self, ms: float) -> Seq:
        self.t += ms / 1000
        return self

    def phase(self, name: str, ms: float, samples: int | None = None, inner: list[tuple[str, float]] = ()) -> Seq:
        self.events.append((BEGIN, self.t, name))
        for sub, sub_ms in inner:
            self.phase(sub, sub_ms)
        self.t += ms / 1000
        self.events.append((END, self.t, (name, samples) if name == "data" else name))
        return self

    def mark(self, code: int) -> Seq:
        self.events.append((code, self.t, None))
        return self

    def nograd_forward(self, ms: float) -> Seq:
        return self.mark(NOGRAD_FORWARD).phase("forward", ms)

    def run(self) -> list:
        tracker = StepTracker()
        out = [tracker.feed(c, t, a) for c, t, a in self.events]
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
    # the 4th step has no following forward: it is not complete yet
    assert len(steps) == 3
    assert steps[0].phases["forward"] == pytest.approx(0.002)
    assert steps[0].other == pytest.approx(0.001)


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


def test_lbfgs_closure_inside_optimizer_is_not_counted_twice():
    s = Seq().mark(OPTIMIZER_CREATED)
    for _ in range(2):
        s.phase("data", 1, 16)
        s.phase("optimizer", 2, inner=[("forward", 1), ("backward", 1), ("forward", 1), ("backward", 1)])
    steps = s.run()
    assert len(steps) == 2
    assert steps[0].phases["forward"] == 0 and steps[0].phases["backward"] == 0
    assert steps[0].phases["optimizer"] == pytest.approx(0.006)  # its own 2 ms + the nested 4 ms


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
