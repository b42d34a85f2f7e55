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


def test_a_torch_that_fails_to_import_shows_plain_pythons_traceback(env, tmp_path):
    """torch is imported through perfmon's import hook (it installs the hooks as torch arrives): a torch that fails
    to import (a missing CUDA library) shows the traceback plain python shows, with no frame of that hook."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text('raise ImportError("libcudart.so.12: cannot open shared object")\n')
    script = tmp_path / "imports_torch.py"
    script.write_text("import torch\n")
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 1 and "libcudart" in plain.stderr
    run = tmp_path / "run"
    res = headless(run, str(script), env=env)
    assert res.returncode == 1
    assert _traceback((run / "stderr.log").read_text()) == _traceback(plain.stderr)
