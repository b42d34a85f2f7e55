"""Running the rules: hysteresis so findings neither flicker nor fire on warm-up noise."""

from __future__ import annotations

from dataclasses import dataclass

from perfmon.analysis.rules.base import REGISTRY, STEP_RULES, Config, Facts, Finding
from perfmon.analysis.store import Store


def _run_all(facts: Facts, cfg: Config) -> dict[str, Finding]:
    out: dict[str, Finding] = {}
    few_steps = len(facts.steps) < cfg.min_steps
    for rule_id, (fn, _) in REGISTRY.items():
        if rule_id in cfg.disabled or (few_steps and rule_id in STEP_RULES):
            continue
        try:
            finding = fn(facts, cfg)
        except (ArithmeticError, KeyError, TypeError, ValueError):
            finding = None  # a rule that cannot decide on odd data stays silent
        if finding is not None:
            out[rule_id] = finding
    for finding in list(out.values()):
        for hidden in finding.supersedes:
            out.pop(hidden, None)
    return out


def _sorted(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: f.rank, reverse=True)


def evaluate_once(state: Store, cfg: Config | None = None) -> list[Finding]:
    """All rules that hold now, without hysteresis (reports over a finished recording)."""
    cfg = cfg or Config()
    facts = Facts.from_state(state, cfg)
    if len(facts.steps) < cfg.min_steps and facts.profile is None:
        return []
    return _sorted(list(_run_all(facts, cfg).values()))


@dataclass
class _Track:
    held: int = 0
    missed: int = 0
    active: bool = False
    finding: Finding | None = None


class Engine:
    """Call :meth:`update` periodically (live); :attr:`active` is what to show."""

    def __init__(self, cfg: Config | None = None) -> None:
        self.cfg = cfg or Config()
        self._tracks: dict[str, _Track] = {}
        self.evaluations = 0  # updates with enough steps to run the rules

    @property
    def settled(self) -> bool:
        """Evaluated often enough (``hold``) that a finding that holds would show: "no findings" is an answer."""
        return self.evaluations >= self.cfg.hold

    def update(self, state: Store) -> list[Finding]:
        """Evaluate once; returns the findings that just became active."""
        facts = Facts.from_state(state, self.cfg)
        if len(facts.steps) < self.cfg.min_steps:
            return []
        self.evaluations += 1
        holding = _run_all(facts, self.cfg)
        new = []
        for rule_id in set(holding) | set(self._tracks):
            track = self._tracks.setdefault(rule_id, _Track())
            if rule_id in holding:
                track.held += 1
                track.missed = 0
                track.finding = holding[rule_id]
                if not track.active and track.held >= self.cfg.hold:
                    track.active = True
                    new.append(holding[rule_id])
            else:
                track.held = 0
                track.missed += 1
                if track.active and track.missed >= self.cfg.clear:
                    track.active = False
        return _sorted(new)

    @property
    def active(self) -> list[Finding]:
        return _sorted([t.finding for t in self._tracks.values() if t.active and t.finding is not None])
