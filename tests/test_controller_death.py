"""The controller is SIGKILLed: it can run no cleanup, yet every worker, and whatever the
workers started, is gone within 2 seconds."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil
import pytest

from leaks import memfds_of
from support import alive, read_pids, wait_gone

GONE_WITHIN = 2.0  # the contract
PATIENCE = 3.0  # how long the assertion loop looks, to tell "slow" from "never"

CONTROLLER_IDLE = """
    import os, sys, time
    import unison
    sess = unison.Session(2)
    print(*sess.run(os.getpid), flush=True)
    time.sleep(600)
"""

CONTROLLER_IN_A_LONG_CALL = """
    import os, sys, time
    import unison
    sess = unison.Session(2)
    print(*sess.run(os.getpid), flush=True)
    sess.run(time.sleep, 600)
"""

CONTROLLER_WITH_BUSY_WORKERS = """
    import os, sys, time
    import unison

    def spin():
        while True:
            pass

    sess = unison.Session(2)
    print(*sess.run(os.getpid), flush=True)
    sess.run(spin)
"""

CONTROLLER_WITH_GRANDCHILDREN = """
    import os, subprocess, sys, time
    import unison

    def start_child():
        child = subprocess.Popen(["sleep", "60"])
        return [os.getpid(), child.pid]

    sess = unison.Session(2)
    pids = [p for pair in sess.run(start_child) for p in pair]
    print(*pids, flush=True)
    time.sleep(600)
"""


def _kill_and_time(proc, pids):
    """SIGKILL the controller; return how long each pid took to be gone (None: never)."""
    assert all(alive(p) for p in pids)
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    proc.wait()
    gone_after = dict.fromkeys(pids)
    while time.monotonic() - killed < PATIENCE:
        for p in pids:
            if gone_after[p] is None and not alive(p):
                gone_after[p] = time.monotonic() - killed
        if all(v is not None for v in gone_after.values()):
            break
        time.sleep(0.02)
    return gone_after


def _assert_all_gone(gone_after):
    never = [p for p, t in gone_after.items() if t is None]
    assert not never, f"still running {PATIENCE} s after the controller died: {never}"
    slow = {p: round(t, 2) for p, t in gone_after.items() if t > GONE_WITHIN}
    assert not slow, f"gone, but later than {GONE_WITHIN} s: {slow}"


@pytest.mark.parametrize(
    "script",
    [CONTROLLER_IDLE, CONTROLLER_IN_A_LONG_CALL, CONTROLLER_WITH_BUSY_WORKERS],
    ids=["idle", "in-a-long-call", "workers-spinning"],
)
def test_workers_exit_when_the_controller_is_killed(controller, script):
    proc = controller(script)
    pids = read_pids(proc)
    assert len(pids) == 2
    time.sleep(0.2)  # let the long call start on the workers
    _assert_all_gone(_kill_and_time(proc, pids))


def test_processes_the_workers_started_exit_too(controller):
    proc = controller(CONTROLLER_WITH_GRANDCHILDREN)
    pids = read_pids(proc)
    assert len(pids) == 4  # two workers, each with one child
    _assert_all_gone(_kill_and_time(proc, pids))


# A worker stuck in one long C call holds the GIL: no Python thread of its own can run, so
# the lifeline must not need one. Its grandchild left the process group (setsid) and
# becomes an orphan once the worker dies: it must go too.
CONTROLLER_WITH_WORKERS_HOLDING_THE_GIL = """
    import os, subprocess, sys, time
    import unison

    def start_child():
        child = subprocess.Popen(["sleep", "60"], start_new_session=True)
        return [os.getpid(), child.pid]

    def hold_the_gil():
        return sum(range(10**11))  # one C call, minutes long, never releases the GIL

    sess = unison.Session(2)
    pids = [p for pair in sess.run(start_child) for p in pair]
    ref = sess.call(hold_the_gil)
    time.sleep(0.3)  # let the call start
    print(*pids, flush=True)
    ref.gather()
"""


def test_workers_holding_the_gil_in_a_c_call_exit_with_their_children(controller):
    proc = controller(CONTROLLER_WITH_WORKERS_HOLDING_THE_GIL)
    pids = read_pids(proc)
    assert len(pids) == 4  # two workers, each with one child in a session of its own
    _assert_all_gone(_kill_and_time(proc, pids))


# A session made in a thread that ends at once: nothing tied to the life of that thread
# (e.g. PR_SET_PDEATHSIG set by a process the thread forked) may take the workers along.
CONTROLLER_STARTING_IN_A_SHORT_THREAD = """
    import os, threading, time
    import unison

    box = []
    t = threading.Thread(target=lambda: box.append(unison.Session(2)))
    t.start()
    t.join()
    time.sleep(0.5)  # the thread is gone
    print(*box[0].run(os.getpid), flush=True)
    box[0].close()
    time.sleep(600)
"""


def test_a_session_made_in_a_short_lived_thread_outlives_that_thread(controller):
    proc = controller(CONTROLLER_STARTING_IN_A_SHORT_THREAD)
    pids = read_pids(proc)
    assert len(pids) == 2


# A child the controller forked (multiprocessing's "fork" start, Linux's default before
# Python 3.14) holds a copy of every worker's lifeline: the controller's death closes none.
CONTROLLER_WITH_A_FORKED_HELPER = """
    import os, time
    import unison

    sess = unison.Session(2)
    pids = sess.run(os.getpid)
    helper = os.fork()
    if helper == 0:
        time.sleep(60)
        os._exit(0)
    print(*pids, helper, flush=True)
    time.sleep(600)
"""


def test_workers_exit_when_the_controller_is_killed_though_a_fork_of_it_lives(controller):
    proc = controller(CONTROLLER_WITH_A_FORKED_HELPER)
    *pids, helper = read_pids(proc)
    assert len(pids) == 2
    try:
        _assert_all_gone(_kill_and_time(proc, pids))
        assert alive(helper)  # it held the lifelines all along
    finally:
        os.kill(helper, signal.SIGKILL)  # (init reaps it: it is no child of ours)


# Every segment of a session is a memfd: SIGKILL of the controller and of every process of
# the session must leave nothing of them on the machine (no /dev/shm path, no holder).
CONTROLLER_WITH_SEGMENTS = """
    import os, time
    import numpy as np
    import unison

    sess = unison.Session(2)
    sess.run(lambda: unison.allreduce(np.ones(1 << 16)))  # the collectives' segment too
    print(os.getpid(), *sess.run(os.getpid), flush=True)
    time.sleep(600)
"""


def test_no_segment_outlives_a_sigkill_of_the_controller_and_its_workers(controller):
    proc = controller(CONTROLLER_WITH_SEGMENTS)
    pid, *workers = read_pids(proc)
    tree = {pid, *workers, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
    segments = set().union(*(memfds_of(p) for p in tree))
    kinds = {name.split()[0].rpartition("-")[2] for _, name in segments
             if name.startswith(f"/memfd:unison-{pid}-")}  # the session's own, by kind
    assert {"arena", "coll", "cancel"} <= kinds, segments
    assert not [e for e in os.listdir("/dev/shm") if f"unison-{pid}-" in e]
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    proc.wait()
    assert not wait_gone(tree, PATIENCE)
    inodes = {inode for inode, _ in segments}
    holders = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            held = {name for inode, name in memfds_of(int(entry)) if inode in inodes}
            if held:
                holders[int(entry)] = sorted(held)
    assert not holders, f"the killed session's memfds are still held: {holders}"
