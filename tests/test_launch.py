"""How the job is started: the interpreter it runs on."""

from __future__ import annotations

import os

from perfmon.monitor.launch import plain_python


def test_the_job_runs_on_the_python_one_types(tmp_path):
    """A console script whose shebang names python3.11 runs the job on the venv's ``python`` where it is the same
    file, so the script's ``sys.executable`` reads as under ``python train.py``."""
    (tmp_path / "python3.11").write_text("")
    assert plain_python(str(tmp_path / "python3.11")) == str(tmp_path / "python3.11")  # no python beside it
    os.symlink(tmp_path / "python3.11", tmp_path / "python")
    assert plain_python(str(tmp_path / "python3.11")) == str(tmp_path / "python")
    (tmp_path / "python3").write_text("")  # another interpreter, not the same file
    os.remove(tmp_path / "python")
    (tmp_path / "python").write_text("")
    assert plain_python(str(tmp_path / "python3")) == str(tmp_path / "python3")
    assert plain_python("/opt/pypy/bin/pypy3") == "/opt/pypy/bin/pypy3"
