"""WorkerDied's message stays short however much a dying worker wrote, and it names the
cause where unison knows it instead of guessing from the exit status."""

from __future__ import annotations

import os
import sys
import time

import pytest

import unison
from unison import SessionClosed, WorkerDied


def write_then_exit(lines, chars, newline):
    for i in range(lines):
        sys.stderr.write(f"line {i} " + "z" * chars + ("\n" if newline else ""))
    sys.stderr.flush()
    os._exit(3)


def test_twenty_megabytes_on_stderr_in_one_line_give_a_short_message(make_session):
    sess = make_session(1)
    with pytest.raises(WorkerDied) as info:
        sess.run(write_then_exit, 1, 20_000_000, False)
    died = info.value
    assert died.exitcode == 3
    assert len(str(died)) < 2_000
    assert 0 < len(died.output) <= 100_000  # the launcher keeps a bounded tail
    assert died.output.rstrip("\n").endswith("z" * 1000)
    with pytest.raises(SessionClosed) as closed:
        sess.sync()
    assert len(str(closed.value)) < 3_000


def test_the_message_keeps_the_last_twenty_lines_each_cut_and_output_keeps_more(make_session):
    sess = make_session(1)
    with pytest.raises(WorkerDied) as info:
        sess.run(write_then_exit, 200, 1_500, True)
    text = str(info.value)
    shown = [line for line in text.splitlines() if line.strip().startswith("line ")]
    assert [line.split()[1] for line in shown] == [str(i) for i in range(180, 200)]
    assert all(len(line) < 1_100 for line in shown)
    assert "more characters" in shown[-1]
    assert "line 170 " in info.value.output  # the attribute keeps more than the message


def close_my_lifeline():
    """Nothing in the worker may close the lifeline: the controller's end is the test's."""
    return os.getpid()


def test_a_worker_stopped_by_its_lifeline_says_so_and_blames_no_oom_killer(make_session):
    sess = make_session(2)
    sess.run(close_my_lifeline)
    keeper = sess._res.launcher.workers[1].popen  # type: ignore[attr-defined]
    keeper.stdin.close()  # what the controller's death looks like to a worker
    keeper.wait(10)  # the keeper stops the worker, then itself
    with pytest.raises(WorkerDied) as info:
        sess.sync(timeout=10)
    died = info.value
    assert (died.worker, died.exitcode) == (1, unison.errors.EXIT_CONTROLLER_GONE)
    text = str(died)
    assert "lifeline" in text
    assert "OOM" not in text


def write_junk_to_the_reply_pipe() -> None:
    """Worker code that writes to the wrong fd: its reply pipe."""
    import gc

    from unison.channel.pipe import PipeWorkerChannel

    chan = next(o for o in gc.get_objects() if isinstance(o, PipeWorkerChannel))
    os.write(chan._reply, b"a print to the wrong fd\n")
    time.sleep(60)


def test_a_worker_whose_reply_pipe_breaks_the_format_is_reported_within_seconds(make_session):
    """The controller neither allocates what the junk says (a MemoryError before) nor waits
    for the worker, which sleeps on: WorkerDied names it and says why, and the session
    closes."""
    sess = make_session(2, channel="pipe")
    start = time.monotonic()
    with pytest.raises(WorkerDied, match="break the format") as info:
        sess[1].run(write_junk_to_the_reply_pipe, timeout=20)
    assert "files it opened itself" in str(info.value)  # what to do
    assert info.value.worker == 1
    assert time.monotonic() - start < 5
    with pytest.raises(SessionClosed):
        sess.run(os.getpid)


def test_a_reply_the_controller_cannot_map_blames_the_controller_not_the_worker(
        make_session, monkeypatch):
    """Mapping a reply's shared memory failed in the controller (ENOMEM: past the mappings
    Linux allows a process), and the message said the worker's reply ring held bytes that
    break the format. It now says that the controller could not map it, and why."""
    import errno

    import numpy as np

    from unison.channel import arena

    sess = make_session(2, channel="shm")

    def no_room(self, desc):
        raise OSError(errno.ENOMEM, "mapping shared memory: Cannot allocate memory")

    monkeypatch.setattr(arena.ArenaReader, "view", no_room)
    with pytest.raises(WorkerDied) as info:
        sess[1].run(np.ones, 100_000, timeout=20)
    text = str(info.value)
    assert "could not map its reply's shared memory" in text, text
    assert "break the format" not in text, text


def _close_a_pipe_of_unisons(which: str) -> str:
    """Worker code that closes the pipe channel's command pipe or reply pipe."""
    import gc

    from unison.channel.pipe import PipeWorkerChannel

    chan = next(o for o in gc.get_objects() if isinstance(o, PipeWorkerChannel))
    os.close(chan._cmd if which == "command" else chan._reply)
    return "closed"


@pytest.mark.parametrize("which", ["command", "reply"])
def test_a_pipe_worker_whose_pipe_its_code_closed_dies_saying_so(make_session, which):
    """Before (issue 9, forty-ninth pass; an audit of what worker code does), a pipe worker
    whose code closed its command pipe exited 0 with no reason (its EBADF read as the
    controller gone), and one that closed its reply pipe died of a bare EBADF."""
    sess = make_session(2, channel="pipe")
    with pytest.raises(WorkerDied, match=f"closed or replaced unison's descriptor "
                                         f"[0-9]+ \\(the {which} pipe\\)"):
        sess[1].run(_close_a_pipe_of_unisons, which)
        sess.run(time.sleep, 0.1)
