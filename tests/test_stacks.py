"""sess.stacks() (issue 13): every thread's Python stack on each worker, read through
faulthandler from a signal handler, so it comes even while the main thread holds the GIL in
a regex, sleeps, waits in a collective or runs a long C call. Real workers; the line numbers
asserted are found in this file by their markers."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import time

import pytest

import unison
from support import marked_lines
from unison.debug import stacks as debug_stacks
from unison.debug.stacks import Frame, ThreadStack, WorkerStacks

pytestmark = pytest.mark.timeout(120)

HERE = os.path.realpath(__file__)


# -- what the workers run (by reference: the workers import this module) --------------------------


def busy_regex() -> None:
    re.match(r"(a+)+$", "a" * 34 + "b")  # line: regex


def sleeper() -> None:
    time.sleep(300)  # line: sleep


def in_barrier() -> None:
    unison.barrier()  # line: barrier


def c_call() -> None:
    hashlib.pbkdf2_hmac("sha256", b"secret", b"salt", 10**9)  # line: c_call


def scene() -> None:
    """One call on four workers: each is stuck somewhere else."""
    [busy_regex, sleeper, in_barrier, c_call][unison.rank()]()  # line: scene


LINE = marked_lines(HERE)


def frames_of(ws: WorkerStacks) -> list[Frame]:
    main = ws.main
    assert main is not None, f"no main thread in worker {ws.rank}'s stacks:\n{ws.text}"
    return main.frames


def ours(frames: list[Frame]) -> list[Frame]:
    return [f for f in frames if os.path.realpath(f.file) == HERE]


def wait_for(sess: unison.Session, ok, what: str, timeout: float = 30.0) -> unison.debug.Stacks:
    """Ask for stacks until ``ok(stacks)``: the workers of a fresh session on a loaded machine
    take a while to get into their call."""
    deadline = time.monotonic() + timeout
    while True:
        got = sess.stacks()
        if ok(got):
            return got
        assert time.monotonic() < deadline, f"never saw {what}; last stacks:\n{got}"
        time.sleep(0.1)


def test_each_worker_shows_where_it_is_stuck(make_session):
    sess = make_session(4)
    ref = sess.call(scene)
    want = {0: ("busy_regex", LINE["regex"]), 1: ("sleeper", LINE["sleep"]),
            2: ("in_barrier", LINE["barrier"]), 3: ("c_call", LINE["c_call"])}

    def all_there(got) -> bool:
        return all(any(f.function == fn for f in ours(frames_of(got[r])))
                   for r, (fn, _) in want.items())

    got = wait_for(sess, all_there, "every worker inside its part of the scene")
    assert sorted(got) == [0, 1, 2, 3]
    for r, (fn, line) in want.items():
        ws = got[r]
        assert ws.error == "" and ws.pid == sess._pids[r]
        assert "most recent call first" in ws.text
        frames = frames_of(ws)
        mine = ours(frames)
        # innermost first: the stuck helper, then scene() that called it
        assert mine[0] == Frame(mine[0].file, line, fn), (r, mine)
        assert mine[1].function == "scene" and mine[1].line == LINE["scene"]
        assert frames[-1].function == "<module>"  # the worker's bootstrap, outermost
    # the regex holds the GIL: the innermost frame is re.match, which called into C
    assert frames_of(got[0])[0].function == "match"
    assert frames_of(got[0])[0].file.endswith(  # re.py before Python 3.11
        (os.path.join("re", "__init__.py"), os.path.join(os.sep, "re.py")))
    # sleep and pbkdf2 are C functions: no frame of their own, the caller's line is innermost
    assert frames_of(got[1])[0] == Frame(frames_of(got[1])[0].file, LINE["sleep"], "sleeper")
    assert frames_of(got[3])[0] == Frame(frames_of(got[3])[0].file, LINE["c_call"], "c_call")
    # in the collective: unison's own frames inside in_barrier
    inner = frames_of(got[2])
    k = inner.index(ours(inner)[0])
    assert k > 0 and all(debug_stacks.is_unison(f) for f in inner[:k])
    assert any(f.function == "barrier" for f in inner[:k])
    # the one-line summary an error message uses
    assert debug_stacks.where(got[1]) == (
        f"worker 1 is at {debug_stacks.short_path(HERE)}:{LINE['sleep']} in sleeper() <- "
        f"{debug_stacks.short_path(HERE)}:{LINE['scene']} in scene()")
    assert debug_stacks.where(got[2]).startswith("worker 2 is in unison's barrier(), at ")
    assert str(got).count("main thread") == 4
    del ref


def test_a_call_of_a_c_function_is_inside_the_call_not_between_calls(make_session):
    """A call's function that is itself C (time.sleep, hashlib.pbkdf2_hmac) has no frame:
    the loop's line that called it is innermost, and a timeout's report said "worker 0 is
    in its loop, between calls"."""
    sess = make_session(2)
    for _ in range(5):  # the report waits 0.1 s for the stacks: on a loaded machine a
        with pytest.raises(TimeoutError) as info:  # worker may not answer in time (it says
            sess.run(time.sleep, 60, timeout=0.5)  # so), then the next timeout's asks again
        text = str(info.value)
        assert "between calls" not in text
        if all(f"worker {r} is inside the call's function, in C code" in text for r in (0, 1)):
            break
    else:
        raise AssertionError(text)
    ref = sess.call(hashlib.pbkdf2_hmac, "sha256", b"x", b"y", 10**9)
    for _ in range(5):
        with pytest.raises(TimeoutError) as info:
            ref.get(timeout=0.5)
        assert "between calls" not in str(info.value)
        if "worker 0 is inside the call's function, in C" in str(info.value):
            break
    else:
        raise AssertionError(str(info.value))


def test_the_loop_lines_told_apart_are_its_calls_and_its_receive() -> None:
    """where() tells a C call's function from the wait for a command by the loop's line:
    those read from its code are the lines of worker.py that say so."""
    with open(os.path.join(os.path.dirname(unison.__file__), "worker.py")) as f:
        source = f.read().splitlines()
    first = unison.worker.serve.__code__.co_firstlineno
    end = next(i for i in range(first, len(source)) if source[i].startswith("def "))
    lines = {i + 1: source[i].strip() for i in range(first - 1, end)}
    calls, receive = debug_stacks._loop_lines()
    assert calls == {n for n, text in lines.items() if text.startswith("value = fn(")}
    assert len(calls) == 6
    assert receive == {n for n, text in lines.items() if text == "got = recv()"}
    assert len(receive) == 1


@pytest.mark.parametrize("ring", ["default", "pure"])
def test_a_view_asks_only_its_workers_and_an_idle_worker_says_so(make_session, ring):
    """"pure": the workers run the pure-Python ring, whose loop calls ``_recv`` (bound over
    ``recv``): an idle worker there once read as "in unison's own code, at shm.py:880 in
    _spin_then_sleep()"."""
    env = {r: {"UNISON_PURE": "1"} for r in range(2)} if ring == "pure" else None
    sess = make_session(2, env=env)
    assert sess.run(unison.rank) == [0, 1]
    deadline = time.monotonic() + 10
    while True:  # until it is back in its loop, after its reply (and out of a finalizer
        got = sess[1].stacks()  # or a decoder the collector or a read ran there: a loaded
        ws = got[1]  # machine, CI 2026-12-07, caught one under the pure ring)
        if (ws.main is not None and {"recv", "_recv"} & {f.function for f in ws.main.frames}
                and all(debug_stacks.is_unison(f) for f in ws.main.frames[:-1])):
            break
        assert time.monotonic() < deadline, str(got)
        time.sleep(0.05)
    assert list(got) == [1]
    ws = got[1]
    assert ws.error == "" and ws.main is not None
    assert "serve" in {f.function for f in ws.main.frames}
    assert debug_stacks.where(ws) == "worker 1 is idle (in its loop, between calls)"


def test_every_thread_is_listed(make_session):
    sess = make_session(1)

    def start_threads() -> list[int]:
        import threading

        threads = [threading.Thread(target=time.sleep, args=(60,), daemon=True)
                   for _ in range(3)]
        for t in threads:
            t.start()
        return [t.ident or 0 for t in threads]

    idents = sess.run(start_threads)[0]
    got = sess.stacks()[0]
    listed = {t.ident for t in got.threads}
    assert set(idents) <= listed
    assert sum(t.main for t in got.threads) == 1
    assert len(got.threads) == 4


def idle_threads(n: int) -> int:
    import threading

    never = threading.Event()
    for _ in range(n):
        threading.Thread(target=never.wait, daemon=True).start()
    return threading.active_count()


def test_a_worker_of_over_100_threads_is_not_said_to_be_in_another_one(make_session):
    """faulthandler writes 100 threads at most, the newest first: a worker's main thread
    (the oldest) is then left out, and the report named an idle thread of a pool as where
    the call was. It now says that the main thread is not in the dump."""
    sess = make_session(1)
    assert sess.run(idle_threads, 120) == [121]
    ref = sess.call(time.sleep, 3)
    with pytest.raises(TimeoutError) as raised:
        ref.get(timeout=0.5)
    text = str(raised.value)
    assert "worker 0: its main thread, which runs the call, is not in its stack dump: " \
           "faulthandler writes 100 threads at most" in text, text
    assert "threading.py" not in text, text
    ref.get(timeout=30)


def a_thread_that_blocks_the_stack_signal() -> None:
    """What a C library's thread pool often does: a thread with every signal blocked."""
    import threading

    started = threading.Event()

    def body() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {debug_stacks.SIGNAL})
        started.set()
        threading.Event().wait()

    threading.Thread(target=body, daemon=True).start()
    started.wait()


def test_a_thread_that_always_blocks_the_signal_costs_no_wait(make_session):
    """Such a thread looked like a dump still being written: each worker's ask waited its
    0.2 s, one worker after another (12 workers: 2.0 s, the whole timeout, and "did not
    answer"; a timeout's report, given 0.1 s, said healthy workers did not answer)."""
    sess = make_session(4)
    sess.run(a_thread_that_blocks_the_stack_signal)
    sess.stacks()  # (each file now holds a dump: the next asks look at one standing still)
    t0 = time.monotonic()
    got = sess.stacks()
    took = time.monotonic() - t0
    assert all(not s.error and s.main is not None for s in got.values()), got
    assert took < 0.5, took  # before: 0.8
    with pytest.raises(TimeoutError) as raised:
        sess.run(time.sleep, 2, timeout=0.3)
    assert "did not answer" not in str(raised.value), raised.value
    assert str(raised.value).count("inside the call's function, in C code") == 4, raised.value
    sess.sync(timeout=30)


def test_a_stopped_worker_is_named_at_once_and_answers_again_once_continued(make_session):
    sess = make_session(2)
    pid = sess._pids[1]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        got = sess.stacks(timeout=2.0)
        assert time.monotonic() - t0 < 1.5  # no waiting on a process that cannot answer
        assert got[0].error == "" and got[0].main is not None
        assert "stopped" in got[1].error and got[1].threads == []
        assert "stopped" in str(got)
    finally:
        os.kill(pid, signal.SIGCONT)
    got = sess.stacks(timeout=5.0)
    assert got[1].error == "" and got[1].main is not None
    assert sess.run(unison.rank) == [0, 1]  # the signal did no harm


def test_repeated_requests_each_get_one_whole_dump(make_session):
    sess = make_session(2)
    for _ in range(20):
        got = sess.stacks()
        for ws in got.values():
            assert ws.error == ""
            assert ws.text.count("most recent call first") == len(ws.threads) == 1
    assert sess.run(unison.rank) == [0, 1]


def test_a_process_that_is_not_a_worker_is_never_signalled():
    """A worker that joined over TCP from another host has a pid that means nothing here:
    stacks() must say so, and must not signal whatever process has that pid (the real-time
    signal's default action would end it)."""
    proc = subprocess.Popen(["sleep", "30"])
    try:
        got = debug_stacks.collect({0: proc.pid, 1: 2**22 + 12345}, timeout=1.0)
        assert "not a unison worker" in got[0].error
        assert "no process with its pid on this host" in got[1].error
        time.sleep(0.2)
        assert proc.poll() is None  # still running: it was not signalled
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_that_exited_unreaped_is_said_to_have_exited(make_session):
    """A worker that exited while its keeper was stopped stays a zombie, whose fds are
    gone: it was called "not a unison worker of that rank"."""
    sess = make_session(2)
    pid = sess._pids[1]
    with open(f"/proc/{pid}/stat") as f:
        keeper = int(f.read().rsplit(")", 1)[1].split()[1])
    os.kill(keeper, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not debug_stacks._state(pid).startswith("Z"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        got = sess[1].stacks(timeout=2.0)
        assert got[1].error == ("not available: it has exited; its keeper has not reported "
                                "it (is the keeper stopped?)"), got[1].error
    finally:
        os.kill(keeper, signal.SIGCONT)


def test_stacks_after_close_raise(make_session):
    sess = make_session(1)
    sess.close()
    with pytest.raises(unison.SessionClosed):
        sess.stacks()


def test_parse_reads_faulthandler_text():
    text = ('Thread 0x00007f0000000001 (most recent call first):\n'
            '  File "/x/a.py", line 3 in inner\n'
            '  File "/x/a.py", line 9 in outer\n'
            '\n'
            'Current thread 0x00007f0000000002 (most recent call first):\n'
            '  File "/x/b.py", line ??? in <module>\n')
    threads = debug_stacks.parse(text, main=0x7f0000000002)
    assert [t.ident for t in threads] == [0x7f0000000001, 0x7f0000000002]
    assert threads[0].frames == [Frame("/x/a.py", 3, "inner"), Frame("/x/a.py", 9, "outer")]
    assert threads[1].main and threads[1].frames == [Frame("/x/b.py", 0, "<module>")]


def test_idle_is_waiting_in_the_channel_for_a_command_and_nothing_else() -> None:
    """where() calls a worker idle only when its loop's own call is a channel's receive:
    not when the loop is stuck sending a reply (a full ring), nor when the loop runs
    unison's collective ``recv`` itself (``sess.run(unison.recv, ...)``)."""
    unison_dir = os.path.dirname(os.path.abspath(unison.__file__))
    shm = os.path.join(unison_dir, "channel", "shm.py")
    coll = os.path.join(unison_dir, "collective", "shm.py")
    serve = Frame(os.path.join(unison_dir, "worker.py"), 247, "serve")
    boot = Frame(os.path.join(unison_dir, "worker.py"), 691, "run")

    def where(*inner: Frame) -> str:
        thread = ThreadStack(1, True, [*inner, serve, boot])
        return debug_stacks.where(WorkerStacks(1, 42, "", [thread]))

    idle = "worker 1 is idle (in its loop, between calls)"
    assert where(Frame(shm, 880, "_spin_then_sleep"), Frame(shm, 795, "recv")) == idle
    assert where(Frame(shm, 880, "_spin_then_sleep"), Frame(shm, 795, "_recv")) == idle
    assert where(Frame(shm, 950, "_put"), Frame(shm, 900, "reply")) != idle
    assert where(Frame(coll, 700, "_wait"), Frame(coll, 742, "recv")) != idle
