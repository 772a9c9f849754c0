"""What a worker starts dies with it, even a process that left its process group
(``start_new_session=True``), and neither close() nor WorkerDied waits on such a process
(it holds the worker's output pipes, so waiting for their EOF would wait for it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from support import alive, wait_dead, wait_gone
from unison import WorkerDied


def start_setsid_child():
    return subprocess.Popen(["sleep", "60"], start_new_session=True).pid


def start_setsid_grandchild():
    """A child that starts a setsid grandchild and exits, so the grandchild is an orphan; it
    keeps the worker's stderr pipe open."""
    code = ("import subprocess, sys\n"
            "p = subprocess.Popen(['sleep', '60'], start_new_session=True, stdout=sys.stderr)\n"
            "print(p.pid)")
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         check=True, timeout=30).stdout
    return int(out)


def exit_with(code):
    os._exit(code)


def test_close_does_not_wait_on_a_setsid_child_and_leaves_none(make_session):
    sess = make_session(2)
    workers = sess.run(os.getpid)
    child = sess[0].run(start_setsid_child)[0]
    assert alive(child)
    start = time.monotonic()
    sess.close()
    took = time.monotonic() - start
    assert wait_gone([child, *workers], 2.0) == []
    assert took < 1.0, f"close() took {took:.2f} s"


def test_close_kills_orphaned_setsid_grandchildren_holding_the_output_pipes(make_session):
    sess = make_session(2)
    grandchild = sess[1].run(start_setsid_grandchild)[0]
    assert alive(grandchild)
    start = time.monotonic()
    sess.close()
    took = time.monotonic() - start
    assert wait_gone([grandchild], 2.0) == []
    assert took < 1.0, f"close() took {took:.2f} s"


def test_a_worker_that_dies_with_a_setsid_child_gives_worker_died_promptly(make_session):
    sess = make_session(2)
    child = sess[0].run(start_setsid_child)[0]
    start = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        sess[0].run(exit_with, 5)
    took = time.monotonic() - start
    assert (info.value.worker, info.value.exitcode) == (0, 5)
    assert took < 1.0, f"WorkerDied came after {took:.2f} s"
    assert wait_gone([child], 2.0) == []


def test_a_worker_killed_from_outside_takes_its_orphaned_grandchildren_along(make_session):
    sess = make_session(2)
    worker = sess[1].run(os.getpid)[0]
    keeper = sess[1].run(os.getppid)[0]
    grandchild = sess[1].run(start_setsid_grandchild)[0]
    os.kill(worker, 9)
    # kill() returns before the worker has ended; sync() owes WorkerDied only for a death
    # that has happened (a worker that finished all it was sent and is still dying owes
    # nothing), so wait until it no longer runs. The session learns of it when the worker's
    # keeper (the process the launcher started) ends, after it has killed what the worker
    # left behind: a few ms later, which a sync right after the worker's end could beat.
    wait_dead(worker)
    wait_dead(keeper)
    start = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        sess.sync()
    took = time.monotonic() - start
    assert info.value.exitcode == -9
    assert took < 1.0, f"WorkerDied came after {took:.2f} s"
    assert wait_gone([grandchild], 2.0) == []
