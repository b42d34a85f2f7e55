"""A crash inside code perfmon wraps (DataLoader fetch, a root forward) prints plain python's traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

try:  # tests/ has no __init__.py: pytest puts it on sys.path (rootdir "prepend" import mode)
    from test_e2e import REPO, env, headless  # noqa: F401 - env is a fixture
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_e2e import REPO, env, headless  # noqa: F401

pytestmark = pytest.mark.e2e


def _traceback(text: str) -> str:
    start = text.find("Traceback (most recent call last):")
    assert start >= 0, text
    return text[start:].strip()


def test_dataset_error_traceback_has_no_perfmon_frame(env, tmp_path):
    script = "demos/loops/dataset_error.py"
    plain = subprocess.run([sys.executable, script], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 1 and "corrupt sample 9" in plain.stderr
    run = tmp_path / "run"
    res = headless(run, script, env=env)
    assert res.returncode == 1
    tb = _traceback((run / "stderr.log").read_text())
    frames = re.findall(r'^  File "([^"]+)"', tb, re.M)
    assert not any(Path(f).parent.name == "agent" and Path(f).name == "hooks.py" for f in frames), tb
    assert tb == _traceback(plain.stderr)
