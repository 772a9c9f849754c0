"""What workers print reaches the controller's stdout and stderr, each line prefixed with
"[worker r] ", in order per worker and stream, complete once the session is closed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import unison

LINES = 100

PRINTER = """
    import sys
    import unison

    def chatter(n):
        r = unison.rank()
        for i in range(n):
            print(f"out {r} {i}")
            print(f"err {r} {i}", file=sys.stderr)

    sess = unison.Session(3)
    sess.run(chatter, LINES)
    sess.close()
    print("controller done", flush=True)
"""


def _run_controller(code):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stderr


def _lines_of(text, rank):
    prefix = f"[worker {rank}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def test_every_line_arrives_prefixed_and_in_order_per_worker():
    out, err = _run_controller(PRINTER.replace("LINES", str(LINES)))
    for rank in range(3):
        assert _lines_of(out, rank) == [f"out {rank} {i}" for i in range(LINES)]
        assert _lines_of(err, rank) == [f"err {rank} {i}" for i in range(LINES)]
    assert "controller done" in out


def test_stdout_and_stderr_are_not_mixed_up():
    out, err = _run_controller(PRINTER.replace("LINES", "5"))
    assert not [line for line in out.splitlines() if "err " in line]
    assert not [line for line in err.splitlines() if "out " in line]


def test_every_relayed_line_is_whole():
    out, err = _run_controller(PRINTER.replace("LINES", str(LINES)))
    for text in (out, err):
        for line in text.splitlines():
            assert line == "controller done" or line.startswith("[worker "), line


def test_a_last_line_without_a_newline_is_not_lost():
    out, _ = _run_controller(
        """
        import unison
        sess = unison.Session(2)
        sess[1].run(print, "no newline at the end", end="")
        sess.close()
        """
    )
    assert _lines_of(out, 1) == ["no newline at the end"]


def test_output_reaches_the_controllers_streams_by_close(capfd):
    def say(word):
        print(word, unison.rank(), flush=True)
        print(word, "on stderr", unison.rank(), file=sys.stderr, flush=True)

    sess = unison.Session(2)
    try:
        sess.run(say, "hello")
    finally:
        sess.close()
    out, err = capfd.readouterr()
    assert "[worker 0] hello 0" in out.splitlines()
    assert "[worker 1] hello 1" in out.splitlines()
    assert "[worker 1] hello on stderr 1" in err.splitlines()


def test_output_printed_just_before_an_unclosed_session_exits_is_not_lost():
    out, _ = _run_controller(
        """
        import unison
        sess = unison.Session(2)
        sess.run(print, "said at the very end")
        """
    )
    assert _lines_of(out, 0) == ["said at the very end"]
    assert _lines_of(out, 1) == ["said at the very end"]


# Whatever the user puts in sys.stdout, the relay lives on, so a worker that prints more than
# a pipe holds (64 KiB) never blocks. Each case prints over 1 MB per worker, twice.
STDOUT_REPLACED = """
    import sys
    import unison

    class NoFlush:
        def __init__(self):
            self.size = 0
        def write(self, text):
            self.size += len(text)

    class Raising:
        def write(self, text):
            raise RuntimeError("this stream refuses")
        def flush(self):
            pass

    def shout(n):
        for _ in range(n):
            print("x" * 1000)
        return n

    sess = unison.Session(2)
    keep = sys.stdout
    sys.stdout = REPLACEMENT
    results = [sess.run(shout, 1200, timeout=60), sess.run(shout, 1200, timeout=60)]
    sess.close()  # the relay reads the workers' output to its end before close returns
    got = sys.stdout
    sys.stdout = keep
    print("results", results, type(got).__name__, getattr(got, "size", None), flush=True)
"""


@pytest.mark.parametrize("replacement", ["NoFlush()", "Raising()", "None"])
def test_the_relay_survives_any_stdout_and_never_blocks_the_workers(replacement):
    out, err = _run_controller(STDOUT_REPLACED.replace("REPLACEMENT", replacement))
    assert "results [[1200, 1200], [1200, 1200]]" in out, err
    if replacement == "NoFlush()":
        size = int(out.split("NoFlush")[1].split()[0])
        assert size >= 2 * 2 * 1200 * 1000  # it got every line


def test_a_huge_line_without_a_newline_is_relayed_in_pieces(capfd):
    sess = unison.Session(1)
    try:
        sess.run(lambda: print("y" * 3_000_000, end="", flush=True))
    finally:
        sess.close()
    out, _ = capfd.readouterr()
    relayed = "".join(line.removeprefix("[worker 0] ") for line in out.splitlines())
    assert relayed == "y" * 3_000_000


@pytest.mark.parametrize("char", ["€", "😀", "é"])
def test_a_long_line_of_multibyte_characters_is_relayed_intact(capfd, char):
    """A 64 KiB piece of a line with no newline in sight ended inside a character: decoded
    apart, its two halves each became U+FFFD."""
    sess = unison.Session(1)
    try:
        sess.run(lambda: print("x" + char * 50_000, end="", flush=True))
    finally:
        sess.close()
    out, _ = capfd.readouterr()
    relayed = "".join(line.removeprefix("[worker 0] ") for line in out.splitlines())
    assert "\ufffd" not in relayed
    assert relayed == "x" + char * 50_000


def test_a_line_our_stdout_cannot_encode_is_escaped_and_its_neighbours_arrive():
    """An ASCII stdout (a C locale's console) refused one line, and every line read with it
    was lost in silence."""
    out, err = _run_controller("""
        import io, sys
        import unison
        sys.stdout = io.TextIOWrapper(sys.stdout.buffer, encoding="ascii", line_buffering=True)
        sess = unison.Session(1)
        sess.run(lambda: print("line-1\\nline-2 caf\\u00e9\\nline-3", flush=True))
        sess.run(lambda: print("line-4", flush=True))
        sess.close()
    """)
    assert _lines_of(out, 0) == ["line-1", "line-2 caf\\xe9", "line-3", "line-4"], err
