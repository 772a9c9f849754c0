"""Ctrl-C at the controller: it stops with one KeyboardInterrupt traceback (never one per
worker), and its workers are gone."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

import unison
from support import read_pids, wait_gone

IN_A_LONG_CALL = """
    import os, time
    import unison
    sess = unison.Session(2)
    print(*sess.run(os.getpid), flush=True)
    sess.run(time.sleep, 60)
"""

IN_A_LONG_GATHER_OF_SPINNING_WORKERS = """
    import os
    import unison

    def spin():
        while True:
            pass

    sess = unison.Session(2)
    print(*sess.run(os.getpid), flush=True)
    sess.call(spin).gather()
"""

WHILE_IDLE = """
    import os, time
    import unison
    sess = unison.Session(2)
    print(*sess.run(os.getpid), flush=True)
    time.sleep(60)
"""

IN_A_WITH_BLOCK = """
    import os, time
    import unison
    with unison.Session(2) as sess:
        print(*sess.run(os.getpid), flush=True)
        sess.run(time.sleep, 60)
"""


@pytest.mark.parametrize(
    "script",
    [IN_A_LONG_CALL, IN_A_LONG_GATHER_OF_SPINNING_WORKERS, WHILE_IDLE, IN_A_WITH_BLOCK],
    ids=["long-call", "spinning-workers", "idle", "with-block"],
)
def test_sigint_stops_the_controller_with_one_traceback_and_no_worker_survives(
    controller, script
):
    proc = controller(script, start_new_session=True)
    pids = read_pids(proc)
    time.sleep(0.3)  # the long call is under way
    os.kill(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("the controller did not stop within 10 s of SIGINT")
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err
    assert err.count("Traceback") <= 1, err
    worker_lines = [line for line in err.splitlines() if line.startswith("[worker")]
    assert not worker_lines, err
    assert wait_gone(pids, 2.0) == []


def test_ctrl_c_during_a_wait_stops_the_workers_and_closes_the_session(make_session):
    sess = make_session(2)
    pids = sess.run(os.getpid)
    ref = sess.call(time.sleep, 30)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ref.gather()
    finally:
        timer.cancel()
    assert wait_gone(pids, 2.0) == []
    with pytest.raises(unison.SessionClosed):
        sess.run(unison.rank)


def test_ctrl_c_during_close_still_stops_the_workers_and_lets_go(make_session):
    """close() waiting out its grace for a long call: Ctrl-C there kills the workers and
    releases their fds before KeyboardInterrupt goes on (a second close could not: the
    session is closed already). Before, they lived until the call ended."""
    sess = make_session(2)
    pids = sess.run(os.getpid)
    sess.call(time.sleep, 30)
    fds_before = len(os.listdir("/proc/self/fd"))
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            sess.close(timeout=10)
    finally:
        timer.cancel()
    assert wait_gone(pids, 2.0) == []
    assert len(os.listdir("/proc/self/fd")) < fds_before  # pidfds and pipes let go


def _held(name: str) -> list[str]:
    """This process's fds that name session ``name``, and its mapping of the session's
    control segment (the workers' reply arenas stay mapped while the Session object lives:
    a fetched array may be a view of them)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if name in target:
            out.append(f"fd {fd} -> {target}")
    with open("/proc/self/maps") as maps:
        out += [line.strip() for line in maps if f"{name}-ctl" in line]
    return out


@pytest.mark.parametrize("wait", ["run", "sync"])
def test_ctrl_c_in_a_wait_lets_go_of_the_sessions_memory_while_its_traceback_lives(
    make_session, wait
):
    """The traceback of a KeyboardInterrupt keeps the frames of the wait alive (a REPL keeps
    it as sys.last_traceback), and with them the channel's C helper: the session it closed
    must still let go of its shared memory and fds."""
    sess = make_session(2)
    sess.run(unison.rank)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            if wait == "run":
                sess.run(time.sleep, 30)
            else:
                sess.call(time.sleep, 30)
                sess.sync()
    finally:
        timer.cancel()
    assert caught.value.__traceback__ is not None  # held here, as a REPL would
    assert _held(sess.name) == []
