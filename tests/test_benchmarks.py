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
def test_agent_cpu_runs_with_and_without_perfmon(env: dict[str, str]) -> None:  # noqa: F811
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "agent_cpu.py"), "--job", "tiny", "--runs", "1",
                          "--steps", "200", "--warmup", "10"], capture_output=True, text=True, timeout=600,
                         check=True, env=env).stdout
    assert re.search(r"^run 0 with\s*: process [\d.]+ us/step", out, re.M), out
    assert re.search(r"^run 0 without: process [\d.]+ us/step", out, re.M), out
    assert re.search(r"perfmon costs [+-][\d.]+ us/step", out), out
    assert re.search(r"in-loop wall time ratio [\d.]+ \(medians\); paired: median [\d.]+, mean [\d.]+$", out, re.M), out
