"""The benchmarks keep working as the code changes: each runs for a moment and prints every figure it promises.
No timing is asserted here (timing claims live in benchmarks/README.md)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from test_e2e import REPO, env  # noqa: F401  (env: private runtime dir)


@pytest.mark.e2e
def test_hook_floor_prints_every_way() -> None:
    from perfmon.agent.hooks import accelerator

    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "hook_floor.py"), "--job", "tiny", "--blocks",
                          "2", "--block-steps", "20"], capture_output=True, text=True, timeout=300, check=True).stdout
    ways = ["none", "floor", "perfmon-py"] + (["perfmon-c"] if accelerator() is not None else [])
    for way in ways:
        assert re.search(rf"^\s+{way}\s+median\s+[\d.]+ us .*paired median\s+[+-][\d.]+$", out, re.M), out


@pytest.mark.e2e
def test_wake_floor_prints_each_way_it_can_run() -> None:
    import shutil

    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "wake_floor.py"), "--seconds", "0.3",
                          "--periods", "0.05"], capture_output=True, text=True, timeout=120, check=True).stdout
    assert re.search(r"^python\s+0.05\s+[\d.]+\s+[\d.]+ / [\d.]+ / [\d.]+ us$", out, re.M), out
    if any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        assert re.search(r"^C\s+0.05\s+[\d.-]+\s+", out, re.M), out


@pytest.mark.e2e
def test_agent_cpu_runs_with_and_without_perfmon(env: dict[str, str]) -> None:  # noqa: F811
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "agent_cpu.py"), "--job", "tiny", "--runs", "1",
                          "--steps", "200", "--warmup", "10"], capture_output=True, text=True, timeout=600,
                         check=True, env=env).stdout
    assert re.search(r"^run 0 with\s*: process [\d.]+ us/step", out, re.M), out
    assert re.search(r"^run 0 without: process [\d.]+ us/step", out, re.M), out
    assert re.search(r"perfmon costs [+-][\d.]+ us/step", out), out
    assert re.search(r"in-loop wall time ratio [\d.]+ \(medians\); paired: median [\d.]+, mean [\d.]+$", out, re.M), out


@pytest.mark.e2e
@pytest.mark.parametrize("way", ["none", "c", "py"])
def test_hook_instructions_measured_program_runs_each_way(way: str, tmp_path) -> None:
    """The program hook_instructions.py runs under valgrind (valgrind itself is too slow for the suite), and the
    totals line it reads from callgrind's output."""
    from perfmon.agent.hooks import accelerator

    if way == "c" and accelerator() is None:
        pytest.skip("the C hot path is not built here")
    script = REPO / "benchmarks" / "hook_instructions.py"
    res = subprocess.run([sys.executable, str(script), "--train", "--job", "tiny", "--way", way, "--steps", "5"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "perfmon error" not in res.stderr, res.stderr
    sys.path.insert(0, str(script.parent))
    import hook_instructions

    out = tmp_path / "callgrind.out"
    out.write_text("events: Ir I1mr D1mr DLmr\nsummary: 10 2 3 0\ntotals: 10 2 3 1\n")
    assert hook_instructions.totals(out) == {"Ir": 10, "I1mr": 2, "D1mr": 3, "DLmr": 1}


@pytest.mark.e2e
def test_agent_blocks_starts_and_finishes_whole_agents_in_one_process(env: dict[str, str]) -> None:  # noqa: F811
    """Each on block runs a fresh agent with a monitor reading its socket, and must count exactly the steps it ran
    (the benchmark exits non-zero otherwise); no perfmon thread outlives its block."""
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "agent_blocks.py"), "--job", "tiny", "--pairs",
                          "2", "--block-s", "0.05"], capture_output=True, text=True, timeout=300, check=True,
                         env=env).stdout
    assert len(re.findall(r"^pair +\d: wall +[\d.]+ -> +[\d.]+ us \([\d.]+\) +process CPU", out, re.M)) == 2, out
    assert re.search(r"^in-loop wall ratio: median [\d.]+, mean [\d.]+ \+- [\d.]+ \(95%", out, re.M), out
    assert re.search(r"^  geometric mean [\d.]+ \(95%: [\d.]+ to [\d.]+\)$", out, re.M), out
    assert re.search(r"^  Hodges-Lehmann [\d.]+ \(95%, Wilcoxon: [\d.]+ to [\d.]+\)$", out, re.M), out
    # tiny blocks: the process and thread clocks are read a moment apart, so ~0 may print as -0.00
    assert re.search(r"perfmon's threads: median -?[\d.]+ us, mean -?[\d.]+ us$", out, re.M), out
    assert re.search(r"^training thread asleep \(the GIL\): [\d.]+ us/step on, [\d.]+ off: [+-][\d.]+ \+- [\d.]+ "
                     r"us/step; waiting for a CPU: [+-][\d.]+ \+- [\d.]+ us/step", out, re.M), out


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["fed", "self-sampled"])
def test_agent_threads_names_each_of_perfmons_threads(env: dict[str, str], mode: str) -> None:  # noqa: F811
    extra = ["--self-sampled"] if mode == "self-sampled" else []
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "agent_threads.py"), "--job", "tiny",
                          "--seconds", "0.5", *extra], capture_output=True, text=True, timeout=300, check=True,
                         env=env).stdout
    said = "sampled by the job" if extra else "sampled by a feed"
    assert re.search(rf"^job tiny as fast as it goes: \d+ steps in [\d.]+ s \(\d+ steps/s\), monitor connected, "
                     rf"{said}$", out, re.M), out
    for thread in ("MainThread", "perfmon-agent", "perfmon-server"):
        assert re.search(rf"^  {thread} +[\d.]+ ms/s +[\d.]+ us/step +[\d.]+ runs/s$", out, re.M), out
    # fed, the job runs no sampler thread: the launcher's feed (here a process of its own) reads the host
    assert ("  perfmon-sampler " in out) == (mode == "self-sampled"), out
    assert re.search(r"^  perfmon in all +[\d.]+ ms/s +[\d.]+ us/step$", out, re.M), out


@pytest.mark.e2e
def test_agent_threads_paced_at_given_step_rates(env: dict[str, str]) -> None:  # noqa: F811
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "agent_threads.py"), "--job", "tiny",
                          "--seconds", "1", "--rates", "0,40"], capture_output=True, text=True, timeout=300,
                         check=True, env=env).stdout
    assert re.search(r"^job tiny paced at 0 steps/s: 0 steps in [\d.]+ s \(0 steps/s\)", out, re.M), out
    paced = re.search(r"^job tiny paced at 40 steps/s: (\d+) steps in ([\d.]+) s", out, re.M)
    assert paced and 0.5 * 40 <= int(paced[1]) <= 40 * float(paced[2]) + 1, out  # the pace, never faster
    assert len(re.findall(r"^  perfmon in all +[\d.]+ ms/s", out, re.M)) == 2, out


def test_hodges_lehmann_centre_and_interval() -> None:
    """The estimate is the median of the pairwise means, and its interval covers a true shift hidden in
    heavy-tailed noise as often as 95% says (the interval the ratio goal is read from)."""
    import random

    sys.path.insert(0, str(REPO / "benchmarks"))
    from agent_blocks import hodges_lehmann

    assert hodges_lehmann([1.0, 2.0, 3.0]) == (2.0, 1.0, 3.0)
    assert hodges_lehmann([0.0, 0.0, 0.0, 10.0])[0] == 0.0  # one wild block does not move it
    rng = random.Random(7)
    shift, covered, trials = 0.01, 0, 300
    for _ in range(trials):
        values = [shift + (rng.gauss(0, 0.4) if rng.random() < 0.1 else rng.gauss(0, 0.1)) for _ in range(60)]
        _, lo, hi = hodges_lehmann(values)
        covered += lo <= shift <= hi
    assert 0.92 <= covered / trials <= 0.99, covered
