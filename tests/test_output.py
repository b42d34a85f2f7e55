"""A launched job's stdout and stderr, re-opened so that a run dir without room never fails the script: they
read as python's own did."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import io, json, sys
from perfmon.agent import output
before = {n: (s.name, s.mode, s.encoding, s.errors, s.line_buffering, s.write_through,
              isinstance(s.buffer, io.FileIO)) for n, s in (("out", sys.stdout), ("err", sys.stderr))}
output.keep_going_on_full_disk(lambda: None)
after = {n: (s.name, s.mode, s.encoding, s.errors, s.line_buffering, s.write_through,
             isinstance(s.buffer, io.FileIO)) for n, s in (("out", sys.stdout), ("err", sys.stderr))}
print(json.dumps([before, after, sys.stdout is sys.__stdout__, sys.stderr is sys.__stderr__]))
"""


@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "unbuffered"])
def test_the_reopened_streams_keep_pythons_names_modes_and_buffering(tmp_path, unbuffered):
    """PYTHONUNBUFFERED=1 (-u) wrote ``sys.stdout.write(".")`` through at once; a BufferedWriter put between held
    it to the end. ``mode`` was missing and ``name`` read 1 instead of "<stdout>"."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
        subprocess.run([sys.executable, "-c", PROBE], stdout=out, stderr=err, env=env, check=True, timeout=60)
    before, after, same_out, same_err = json.loads((tmp_path / "out").read_text())
    assert after == before and same_out and same_err
    assert before["out"][0] == "<stdout>" and before["out"][6] == bool(unbuffered)
