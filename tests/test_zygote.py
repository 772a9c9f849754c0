"""Local workers forked from one zygote (unison.launch.zygote): one layout for all of them,
their exit statuses, an environment per rank, and what happens when the zygote goes."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import sys
import threading
import time

import psutil
import pytest

import unison
from support import open_fds
from unison.errors import WorkerDied
from unison.launch import zygote

pytestmark = pytest.mark.skipif(not zygote.usable(None), reason="no pidfds or fd passing")


def first_mapping() -> str:
    with open("/proc/self/maps") as f:
        return f.readline().split("-")[0]


def hash_randomization() -> int:
    return int(sys.flags.hash_randomization)


def getenv(name: str) -> str | None:
    return os.environ.get(name)


def test_the_workers_share_one_layout_that_is_not_the_controllers(make_session) -> None:
    sess = make_session(3)
    layouts = sess.run(first_mapping)
    assert len(set(layouts)) == 1, layouts  # forked from one process
    zyg = sess._res.launcher._zygote
    assert zyg is not None and zyg.popen.poll() is None
    keepers = [psutil.Process(pid) for pid in sess.run(os.getppid)]
    assert {keeper.ppid() for keeper in keepers} == {zyg.popen.pid}  # not our children


def test_an_environment_per_rank_reaches_its_worker(make_session) -> None:
    sess = make_session(2, env={1: {"UNISON_TEST_ZYGOTE": "one"}})
    assert sess.run(getenv, "UNISON_TEST_ZYGOTE") == [None, "one"]
    assert len(set(sess.run(first_mapping))) == 1  # still forked


def test_a_variable_read_at_start_gives_the_workers_interpreters_of_their_own(
        make_session) -> None:
    """PYTHONHASHSEED is read as an interpreter starts: set after a fork it would do nothing,
    so the workers start as interpreters of their own, and it takes."""
    assert not zygote.usable({1: {"PYTHONHASHSEED": "0"}})
    assert not zygote.usable({0: {"LD_PRELOAD": ""}})
    assert zygote.usable({0: {"CUDA_VISIBLE_DEVICES": "0"}})
    sess = make_session(2, env={1: {"PYTHONHASHSEED": "0"}})
    assert sess.run(hash_randomization) == [1, 0]
    assert sess._res.launcher._zygote is None


def local_time_zone() -> tuple[str | None, tuple[str, str]]:
    import time as t

    return os.environ.get("TZ"), t.tzname


def test_a_time_zone_or_locale_per_rank_takes_in_a_forked_worker(make_session) -> None:
    """TZ (and LC_*, LANG) are read by the C library once: a worker forked from the zygote
    showed the rank's TZ in os.environ and kept the zygote's zone. They now get
    interpreters of their own, as PYTHON* variables do."""
    assert not zygote.usable({1: {"TZ": "XYZ-9"}})
    assert not zygote.usable({1: {"LC_ALL": "C"}}) and not zygote.usable({1: {"LANG": "C"}})
    sess = make_session(2, env={1: {"TZ": "XYZ-9"}})
    assert sess.run(local_time_zone)[1] == ("XYZ-9", ("XYZ", "XYZ"))


def test_a_start_timeout_past_the_zygotes_own_minute_is_kept(monkeypatch) -> None:
    """The zygote's fork wait was the lesser of its own 60 s and the start deadline: a
    longer start_timeout (a slow sitecustomize) was cut to 60 s, with a RuntimeError that
    blamed limits on processes. (Here its minute is made 0.5 s, its start 2 s.)"""
    monkeypatch.setattr(zygote, "_FORKING", 0.5)
    monkeypatch.setattr(zygote, "_BOOTSTRAP", "import time; time.sleep(2)\n" + zygote._BOOTSTRAP)
    with unison.Session(2, start_timeout=30) as sess:
        assert sess.run(unison.rank) == [0, 1]


def test_ctrl_c_while_close_waits_for_the_zygote_still_ends_it(monkeypatch) -> None:
    """A KeyboardInterrupt in Zygote.end's wait (the zygote not scheduled: here stopped)
    left its socket open and the zygote running, unreaped, until the session was
    collected."""
    ended = zygote.Zygote.end

    def interrupted(self: zygote.Zygote) -> None:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        ended(self)

    monkeypatch.setattr(zygote.Zygote, "end", interrupted)
    before = open_fds()
    sess = unison.Session(2)
    pid = sess._res.launcher._zygote.popen.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(KeyboardInterrupt):
            sess.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert not psutil.pid_exists(pid), "the zygote is left (running, or unreaped)"
    sockets = [target for _, target in open_fds() - before if target.startswith("socket:")]
    assert sockets == [], sockets

def exit_with(code: int) -> None:
    os._exit(code)


def test_a_forked_workers_exit_status_comes_through(make_session) -> None:
    sess = make_session(2)
    with pytest.raises(WorkerDied) as info:
        sess[1].run(exit_with, 7)
    assert (info.value.worker, info.value.exitcode) == (1, 7)


def test_a_zygote_late_to_report_is_waited_for_not_taken_for_gone(make_session) -> None:
    """A zygote not scheduled for a while (SIGSTOP here; a loaded machine or a CPU quota
    elsewhere) reports a keeper's end late: its status still comes through. It was taken
    for a zygote that had ended, and the status was lost, once the report was 1 s late."""
    sess = make_session(2)
    zyg = sess._res.launcher._zygote.popen.pid
    os.kill(zyg, signal.SIGSTOP)
    wake = threading.Timer(2.5, os.kill, (zyg, signal.SIGCONT))
    wake.start()
    try:
        with pytest.raises(WorkerDied) as info:
            sess[1].run(exit_with, 7)
    finally:
        wake.join()
    assert (info.value.worker, info.value.exitcode) == (1, 7), str(info.value)


def test_a_report_not_yet_come_is_not_yet_known_and_eof_is_unknown() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    reports = zygote._Reports(ours)
    try:
        assert reports.status(123, 0.05) is None  # late: ask again
        theirs.sendall(zygote._REPORT.pack(123, 7 << 8))
        assert reports.status(123, 0.05) == 7
        theirs.close()
        assert reports.status(456, 0.05) == zygote.UNKNOWN  # the zygote is gone
    finally:
        reports.close()
        theirs.close()


def test_the_zygote_leaves_with_the_session(make_session) -> None:
    sess = make_session(2)
    zyg = sess._res.launcher._zygote
    assert zyg is not None
    sess.close()
    assert zyg.popen.poll() is not None  # reaped
    assert zyg.reports._sock.fileno() == -1  # closed


def test_a_killed_zygote_takes_the_workers_along_and_the_session_says_so(
        make_session) -> None:
    """The keepers check their parent each second: without the zygote they stop their
    workers, and the session hears of a death within a few seconds, never hangs."""
    sess = make_session(2)
    zyg = sess._res.launcher._zygote
    assert zyg is not None
    os.kill(zyg.popen.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        for _ in range(1000):
            sess.run(time.sleep, 0.01)
    assert time.monotonic() - start < 10
    assert info.value.exitcode is None or info.value.exitcode == unison.errors.EXIT_CONTROLLER_GONE


def test_a_zygote_that_dies_at_once_fails_the_start_and_leaves_nothing(monkeypatch) -> None:
    """(The leak check after each test asserts that no fd, process or thread is left.)"""
    monkeypatch.setattr(zygote, "_BOOTSTRAP", "import os; os._exit(3)  # {path} {pid}")
    with pytest.raises(Exception, match="zygote ended") as info:
        unison.Session(2, start_timeout=30)
    assert "every worker" in str(info.value)
    # how it ended (it said "ended, or did not answer within 60 s" and blamed limits)
    assert "exited with code 3" in str(info.value), str(info.value)


@pytest.mark.parametrize("how", ["zygote-ended", "start-timeout"])
def test_a_failed_start_closes_the_zygotes_pipe_at_once(monkeypatch, how) -> None:
    """A failed start's exception, kept (to report later), holds the start's frames and with
    them the zygote's Popen: its stdin pipe stayed open until that was collected, one per
    failed start (a ResourceWarning under -X dev). Now the failed start closes it."""
    if how == "zygote-ended":
        monkeypatch.setattr(zygote, "_BOOTSTRAP", "import os; os._exit(3)  # {path} {pid}")
    before = open_fds()
    kept = []
    for _ in range(2):
        with pytest.raises((RuntimeError, TimeoutError)) as info:
            unison.Session(2, start_timeout=30 if how == "zygote-ended" else 0.01)
        kept.append(info.value)
    gc.collect()
    pipes = [target for _, target in open_fds() - before if target.startswith("pipe:")]
    assert pipes == [], (pipes, kept)


def test_a_lone_worker_starts_as_an_interpreter_of_its_own(make_session) -> None:
    """No one to share a layout with: a zygote would only add its start."""
    sess = make_session(1)
    assert sess._res.launcher._zygote is None
    keeper = psutil.Process(sess.run(os.getppid)[0])  # still behind a keeper, ours
    assert keeper.ppid() == os.getpid()


def test_a_kernel_without_pidfds_starts_the_workers_apart(monkeypatch) -> None:
    """Python may have os.pidfd_open on a kernel that lacks it (ENOSYS before Linux 5.3)."""
    def enosys(pid: int, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", enosys)
    zygote._pidfds.cache_clear()
    try:
        assert not zygote.usable(None)
    finally:
        monkeypatch.undo()
        zygote._pidfds.cache_clear()
    assert zygote.usable(None)
