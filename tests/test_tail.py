"""The one file tailer (perfmon/tail.py) and its three users' adapters."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from perfmon import protocol
from perfmon.monitor.headless import LogTail
from perfmon.monitor.left_in_terminal import NEAR_END, last_lines, print_output_tail
from perfmon.recording import RecordingReader
from perfmon.tail import OutputTail, Tail

# A case: Tail options, then steps of (what happens to the file, its bytes, what ``lines()`` gives next).
#   append: bytes added at the end; write: the file rewritten in place (truncated); replace: a new file
#   renamed over it; remove: the file deleted; none: nothing happens.
Step = tuple[str, bytes, list[bytes]]
CASES: dict[str, tuple[dict[str, Any], list[Step]]] = {
    "missing file": ({}, [
        ("none", b"", []),
        ("append", b"a\n", [b"a"]),  # appears later: read from its start
    ]),
    "growth": ({}, [
        ("append", b"one\ntwo\n", [b"one", b"two"]),
        ("none", b"", []),
        ("append", b"three\n", [b"three"]),
        ("append", b"\n", [b""]),  # an empty line is a line
    ]),
    "partial line completed later": ({}, [
        ("append", b"one\ntw", [b"one"]),
        ("append", b"o and", []),
        ("append", b" more\nthr", [b"two and more"]),
        ("append", b"ee\n", [b"three"]),
    ]),
    "truncation": ({}, [
        ("append", b"one\ntwo\npart", [b"one", b"two"]),
        ("write", b"new\n", [b"new"]),  # shorter than what was read: from the start, the partial dropped
        ("append", b"more\n", [b"more"]),
    ]),
    "replacement": ({}, [
        ("append", b"old line\n", [b"old line"]),
        ("replace", b"a longer new file\n", [b"a longer new file"]),  # not shorter: told by its inode
    ]),
    "removed, then back": ({}, [
        ("append", b"one\n", [b"one"]),
        ("remove", b"", []),
        ("append", b"2\n", [b"2"]),  # shorter: read from its start (a same-size file may reuse the inode)
    ]),
    "a line over the read cap": ({"max_read": 4}, [
        ("append", b"abcdefghij\nk\n", []),  # 4 bytes a read: the line is put together over reads
        ("none", b"", []),
        ("none", b"", [b"abcdefghij"]),
        ("none", b"", [b"k"]),
        ("none", b"", []),
    ]),
    "an unterminated line over the line cap": ({"max_line": 5}, [
        ("append", b"ok\n0123456789", [b"ok", b"0123456789"]),  # given out as it stands
        ("append", b"ab\n", [b"ab"]),  # the rest of it: a line of its own
    ]),
    "start near the end": ({"near_end": 8}, [
        ("append", b"first line\nsecond\nthird\n", [b"third"]),  # "second" began before the last 8 bytes
        ("append", b"fourth\n", [b"fourth"]),
    ]),
    "start near the end, at a line start": ({"near_end": 6}, [
        ("append", b"first line\nthird\n", [b"third"]),
    ]),
    "start near the end of a short file": ({"near_end": 100}, [
        ("append", b"one\ntwo\n", [b"one", b"two"]),
    ]),
    "start near the end, file missing at first": ({"near_end": 4}, [
        ("none", b"", []),
        ("append", b"a long first line\nb\n", [b"b"]),  # decided at the first read that finds the file
    ]),
    "start near the end, truncated later": ({"near_end": 4}, [
        ("append", b"one\ntwo\n", [b"two"]),
        ("write", b"x\n", [b"x"]),  # after truncation: all of the new content
    ]),
}


def apply(path: Path, op: str, data: bytes) -> None:
    if op == "append":
        with open(path, "ab") as f:
            f.write(data)
    elif op == "write":
        path.write_bytes(data)
    elif op == "replace":
        new = path.with_suffix(".new")
        new.write_bytes(data)
        os.replace(new, path)
    elif op == "remove":
        path.unlink()
    else:
        assert op == "none"


@pytest.mark.parametrize("options, steps", CASES.values(), ids=CASES.keys())
def test_lines(tmp_path: Path, options: dict[str, Any], steps: list[Step]) -> None:
    path = tmp_path / "file.log"
    tail = Tail(path, **options)
    for i, (op, data, expected) in enumerate(steps):
        apply(path, op, data)
        assert tail.lines() == expected, f"step {i}: {op} {data!r}"


@pytest.mark.parametrize("options, chunks, expected", [
    ({}, [b"ab", b"c\nd", b""], [b"ab", b"c\nd", b""]),  # bytes as they come, partial lines too
    ({"max_read": 2}, [b"abcde", b"", b""], [b"ab", b"cd", b"e"]),
    ({"near_end": 3}, [b"line\nxy\n", b"z"], [b"xy\n", b"z"]),  # near the end: from a line start
])
def test_read_bytes(tmp_path: Path, options: dict[str, Any], chunks: list[bytes],
                    expected: list[bytes]) -> None:
    path = tmp_path / "file.log"
    tail = Tail(path, **options)
    got = []
    for chunk in chunks:
        apply(path, "append", chunk)
        got.append(tail.read())
    assert got == expected


def test_flush_gives_up_the_partial_line(tmp_path: Path) -> None:
    path = tmp_path / "file.log"
    path.write_bytes(b"done\nhalf")
    tail = Tail(path)
    assert tail.lines() == [b"done"]
    assert tail.flush() == b"half"
    assert tail.flush() == b""


def test_read_limit_overrides_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "file.log"
    path.write_bytes(b"a\nb\nc\n")
    tail = Tail(path, max_read=2)
    assert tail.lines(limit=4) == [b"a", b"b"]
    assert tail.lines() == [b"c"] and tail.offset == 6


# -- the adapters ---------------------------------------------------------------------------------


def test_recording_reader_decodes_and_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "MAX_LINE", 200)
    path = tmp_path / "events.jsonl"
    hello = protocol.encode(protocol.message("hello", seq=1))
    path.write_bytes(hello + b"not json\n\n" + hello[:10])
    reader = RecordingReader(path)
    assert [m["type"] for m in reader.read_new()] == ["hello"]
    assert reader.skipped == 1 and reader.errors[0].startswith("not JSON")
    with open(path, "ab") as f:
        f.write(hello[10:] + b"x" * 300)  # the partial line completed, then one over the line limit
    assert [m["type"] for m in reader.read_new()] == ["hello"] and reader.skipped == 2
    assert reader.offset == path.stat().st_size


def test_a_chunked_read_reads_through_a_line_longer_than_the_chunk(tmp_path: Path) -> None:
    """Followers and replays read the recording a chunk at a time; an empty batch means "nothing new". A line
    longer than the chunk (a big profile message), or a chunk of lines that do not decode, is read on through,
    never taken for the end of the file."""
    path = tmp_path / "events.jsonl"
    big = protocol.encode(protocol.message("event", kind="warning", text="x" * 5000, seq=2))
    garbage = b"not a message\n" * 200  # a chunk or two of lines that do not decode: not the end either
    path.write_bytes(protocol.encode(protocol.message("hello", seq=1)) + big + garbage
                     + protocol.encode(protocol.message("hello", seq=3)))
    reader = RecordingReader(path)
    seqs = []
    while batch := reader.read_new(1000):
        seqs += [m["seq"] for m in batch]
    assert seqs == [1, 2, 3] and reader.offset == path.stat().st_size and reader.skipped == 200


def test_log_tail_copies_bytes_as_they_come(tmp_path: Path) -> None:
    path = tmp_path / "output.log"
    out = io.BytesIO()
    tail = LogTail(path, out)
    assert tail.pump() == 0
    path.write_bytes(b"step 1\nprogress 10%\r")
    assert tail.pump() == 20 and out.getvalue() == b"step 1\nprogress 10%\r"
    tail.CHUNK = tail.tail.max_read = 64  # a backlog of many chunks comes whole, a chunk at a time
    backlog = bytes(range(256)) * 5  # 20 chunks
    with open(path, "ab") as f:
        f.write(backlog)
    assert tail.pump() == tail.MAX_CHUNKS * 64  # at most MAX_CHUNKS a call (the status line's turn comes)
    assert tail.pump() == len(backlog) - tail.MAX_CHUNKS * 64 and out.getvalue().endswith(backlog)


def test_output_tail_starts_near_the_end(tmp_path: Path) -> None:
    path = tmp_path / "output.log"
    lines = [f"line {i}".encode() for i in range(100_000)]
    path.write_bytes(b"\n".join(lines) + b"\nunterminated \xff")
    tail = OutputTail(path)
    got = tail.read()
    assert len(got) < len(lines) and got[-1] == "line 99999"
    assert all(line.startswith("line ") for line in got)  # no cut line at the start
    assert tail.flush() == ["unterminated \ufffd"]


def test_script_output_drains_whole_at_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pump() takes a bounded amount a call (the status line gets its turn); once the job is over, drain() copies
    all the rest, the script's last lines included."""
    import types

    from perfmon.monitor.headless import ScriptOutput

    out, err = io.BytesIO(), io.BytesIO()
    monkeypatch.setattr(sys, "stdout", types.SimpleNamespace(buffer=out))
    monkeypatch.setattr(sys, "stderr", types.SimpleNamespace(buffer=err))
    monkeypatch.setattr(LogTail, "CHUNK", 64)
    (tmp_path / "output.log").write_bytes(b"x" * 64 * 40 + b"last line\n")
    (tmp_path / "stderr.log").write_bytes(b"warning\n")
    output = ScriptOutput(tmp_path)
    assert output.pump() == 64 * LogTail.MAX_CHUNKS + len(b"warning\n")
    output.drain()
    assert out.getvalue().endswith(b"last line\n") and len(out.getvalue()) == 64 * 40 + 10
    assert err.getvalue() == b"warning\n"


def test_perfmon_lines_start_below_a_line_the_script_left_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A progress bar redrawn after "\\r", or print(end=""), leaves the terminal mid-line: perfmon's status lines,
    warnings and summary start on the next line instead of on the end of the script's (once: the line is ended)."""
    import types

    from perfmon.monitor import headless
    from perfmon.monitor.headless import ScriptOutput

    out, err = io.BytesIO(), io.BytesIO()
    monkeypatch.setattr(sys, "stdout", types.SimpleNamespace(buffer=out))
    monkeypatch.setattr(sys, "stderr", types.SimpleNamespace(buffer=err))
    monkeypatch.setattr(headless, "same_destination", lambda: False)
    (tmp_path / "output.log").write_bytes(b"")
    (tmp_path / "stderr.log").write_bytes(b"")
    output = ScriptOutput(tmp_path)
    assert output.fresh_line() == ""  # nothing written yet
    with open(tmp_path / "stderr.log", "ab") as f:
        f.write(b"\r 45%|####      | 45/100")
    with open(tmp_path / "output.log", "ab") as f:
        f.write(b"epoch 1 ")
    output.pump()
    assert output.fresh_line() == "\n" and output.fresh_line() == ""
    with open(tmp_path / "stderr.log", "ab") as f:
        f.write(b"done\n")
    output.pump()
    assert output.fresh_line() == ""  # stdout's open line is elsewhere: stdout is not this terminal

    # stdout and stderr one file (a terminal, or `2>&1`): what was written last counts
    monkeypatch.setattr(headless, "same_destination", lambda: True)
    shared = ScriptOutput(tmp_path)
    shared.drain()  # stdout's "epoch 1 ", then stderr's "...done\n"
    assert shared.fresh_line() == ""
    with open(tmp_path / "output.log", "ab") as f:
        f.write(b"epoch 2 ")
    shared.pump()
    assert shared.fresh_line() == "\n" and shared.fresh_line() == ""


def test_a_deleted_file_is_still_read_to_its_end_and_a_new_one_from_its_start(tmp_path: Path) -> None:
    """The script's output file removed under it (a script that clears its output folder): what it writes on
    into the open file is still read; a new file at the path is read from its start."""
    path = tmp_path / "output.log"
    writer = open(path, "ab", buffering=0)  # noqa: SIM115 - the script's fd 1
    tail = Tail(path)
    writer.write(b"one\n")
    assert tail.lines() == [b"one"]
    path.unlink()
    writer.write(b"two\n")
    assert tail.lines() == [b"two"]
    path.write_bytes(b"fresh\n")  # another file at the path
    assert tail.lines() == [b"fresh"]
    writer.close()
    tail.close()


@pytest.mark.parametrize("rewrite", [b"accuracy 0.93\n", b"accuracy 0.93, loss 0.21\n"], ids=["same size", "longer"])
def test_a_file_truncated_and_written_again_past_the_read_offset_is_read_from_its_start(tmp_path, rewrite):
    """``open("/dev/stdout", "w")`` in a script whose stdout is the log truncates it and writes from 0: the file was
    already as long again at the next poll, and the tail went on from its old offset ("accuracy 0.93" lost its
    first 14 bytes)."""
    path = tmp_path / "output.log"
    path.write_bytes(b"epoch 1 done: ")
    tail = Tail(path)
    assert tail.read() == b"epoch 1 done: "
    with open(path, "wb") as f:
        f.write(rewrite)
    assert tail.read() == rewrite  # its mtime may be the same: both writes within one clock tick
    with open(path, "ab") as f:
        f.write(b"next\n")
    assert tail.read() == b"next\n"  # appends after it read on as before


def test_last_lines_left_in_the_terminal_are_what_it_showed(tmp_path):
    """A closed dashboard leaves the script's last lines: a tqdm line as its last redraw, a nested bar's redraw
    (it ends by moving the cursor up) left out, the unterminated end kept; and whether there are more before."""
    out = tmp_path / "output.log"
    out.write_bytes(b"".join(b"line %d\n" % i for i in range(30)) + b"10%|#  \r50%|#### \r100%|########\r\n"
                    + b"inner 3/9\x1b[A\n" + b"accuracy: 0.93")
    lines, more = last_lines(out, count=3)
    assert lines == ["line 29", "100%|########", "accuracy: 0.93"] and more
    lines, more = last_lines(out, count=40)
    assert len(lines) == 32 and lines[0] == "line 0" and not more
    assert last_lines(tmp_path / "missing.log") == ([], False)
    # a file longer than what is read back: more, whatever the count
    out.write_bytes(b"x" * (NEAR_END + 10) + b"\nlast\n")
    assert last_lines(out, count=40) == (["last"], True)


def test_output_tail_names_its_file_when_it_cuts(tmp_path):
    (tmp_path / "output.log").write_text("".join(f"out {i}\n" for i in range(25)))
    (tmp_path / "stderr.log").write_text("warn\nTraceback (most recent call last):\n  x\nValueError: v\n")
    out, err = io.StringIO(), io.StringIO()
    traceback = "Traceback (most recent call last):\n  x\nValueError: v\n"
    shown = print_output_tail(tmp_path, False, out, err, traceback=traceback)
    assert out.getvalue() == "".join(f"out {i}\n" for i in range(5, 25))
    assert err.getvalue().startswith(f"perfmon: the script's stdout, its last 20 lines (all of it: {tmp_path}/output.log)")
    assert err.getvalue().endswith("warn\nTraceback (most recent call last):\n  x\nValueError: v\n")
    assert shown == "warn\nTraceback (most recent call last):\n  x\nValueError: v\n"
