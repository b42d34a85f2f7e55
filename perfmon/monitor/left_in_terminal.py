"""What a closed dashboard leaves in the terminal, as plain python would have: the end of the script's output.

The dashboard draws on the terminal's alternate screen, gone when it closes: the script's last lines (its final
metrics, its traceback) would otherwise be only in the run dir's files.
"""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from perfmon import paths
from perfmon.tail import CURSOR_UP, Tail

#: Lines of each stream left in the terminal; the rest is named by its file.
LINES = 20
#: How far back from a file's end its last lines are looked for (a tqdm line of redraws can be long).
NEAR_END = 64 * 1024
_CURSOR_UP = CURSOR_UP.encode()  # a nested progress bar's redraw, left out as the dashboard's panel does


def last_lines(path: Path, count: int = LINES) -> tuple[list[str], bool]:
    """The last ``count`` lines of ``path`` as a terminal shows them (a ``\\r``-redrawn line: its last
    redraw), its unterminated end included; and whether the file holds more before them."""
    tail = Tail(path, near_end=NEAR_END)
    try:
        raw = tail.lines()
        if rest := tail.flush():
            raw.append(rest)
        size = tail.offset
    finally:
        tail.close()
    lines = [line.rstrip(b"\r").rsplit(b"\r", 1)[-1].decode("utf-8", "replace")
             for line in raw if not line.rstrip(b"\r").endswith(_CURSOR_UP)]
    return lines[-count:], len(lines) > count or size > NEAR_END


def print_output_tail(run_dir: Path, combined: bool, out: TextIO, err: TextIO, traceback: str | None = None) -> str:
    """Write the end of the script's stdout to ``out`` and of its stderr to ``err`` (both to ``out`` where they
    share one file), each under a line naming its file when there is more; returns the stderr text written.
    ``traceback``: the script's last error, whose lines come on top of the usual count (a deep stack would
    otherwise leave no line of the output before it, or lose its own start)."""
    streams = [(paths.OUTPUT_LOG, out)] if combined else [(paths.OUTPUT_LOG, out), (paths.STDERR_LOG, err)]
    count = LINES + len((traceback or "").splitlines())
    written = ""
    for name, stream in streams:
        lines, more = last_lines(run_dir / name, count if stream is err or combined else LINES)
        if not lines:
            continue
        if more:
            what = "output" if combined else "stdout" if name == paths.OUTPUT_LOG else "stderr"
            print(f"perfmon: the script's {what}, its last {len(lines)} lines (all of it: {run_dir / name})",
                  file=err, flush=True)
        text = "\n".join(lines) + "\n"
        stream.write(text)
        stream.flush()
        if stream is err or combined:
            written += text
    return written
