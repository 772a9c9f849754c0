"""Runs last (the name sorts last): nothing the suite started may outlive it. No worker
process, no child process of the test runner, no shared-memory segment named "unison"."""

from __future__ import annotations

import contextlib
import gc
import os

import psutil

from support import stray_workers, wait_gone


def test_no_worker_process_is_left_running():
    gc.collect()  # sessions dropped without close() are closed by now
    left = [p.pid for p in stray_workers()]
    assert wait_gone(left, 3.0) == [], "worker processes outlived the tests"


def test_no_child_process_of_the_test_runner_is_left():
    gc.collect()
    me = psutil.Process()
    children = []
    for child in me.children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(child.pid, os.WNOHANG)  # reap: it runs no code anyway
                continue
            children.append((child.pid, " ".join(child.cmdline())))
        except psutil.NoSuchProcess:
            continue
    still = wait_gone([pid for pid, _ in children], 3.0)
    assert not still, [c for c in children if c[0] in still]


def test_no_shared_memory_segment_is_left(leak_baseline):
    try:
        now = {name for name in os.listdir("/dev/shm") if "unison" in name}
    except FileNotFoundError:
        return
    leaked = sorted(now - leak_baseline["shm"])
    assert not leaked, f"shared-memory segments outlived their sessions: {leaked}"
