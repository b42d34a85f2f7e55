"""The script's view of its stack without the launcher's frames (``perfmon.agent.own_frames``), on frames the
end-to-end tests do not make. Each case runs in a fresh interpreter: the stand-ins are process-wide."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys, traceback
from perfmon.agent import own_frames

def launcher():
    own_frames.hide(sys._getframe())
    script()

def script():
    def work():
        return [f.name for f in traceback.extract_stack()]
    # a code object whose constants cannot be hashed, as dynamo generates them (a compiled function's resume):
    # torch's FakeTensorMode takes extract_stack() with such a frame on the stack
    code = work.__code__
    odd = type(work)(code.replace(co_consts=code.co_consts + ({"unhashable": 1},)), globals())
    print(odd())

launcher()
"""


def test_a_frame_whose_code_cannot_be_hashed_is_walked_past():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['script', 'work']"  # launcher() and below are left out
