"""A session is used only by the process that made it: a forked child that touches it gets a
clear error naming the owner, and the parent's next results are its own."""

from __future__ import annotations

import os
import sys
import time

import pytest

import unison
from support import FORKS_ON_PURPOSE


def square(x):
    return x * x


@FORKS_ON_PURPOSE
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_cannot_use_the_parents_session(sess):
    assert sess.run(square, 3) == [9, 9]
    ref = sess.call(square, 4)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: every use must raise, naming the owner
        code = 0
        for attempt in (lambda: sess.run(square, 100), lambda: ref.gather(),
                        lambda: sess.put(1), lambda: sess.sync(), lambda: sess[0]):
            try:
                attempt()
                code = 1
            except unison.SessionClosed as exc:
                if str(os.getppid()) not in str(exc) or "fork" not in str(exc):
                    code = 2
            except BaseException:
                code = 3
        os.write(write, bytes([code]))
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    verdict = os.read(read, 1)
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert verdict == b"\x00", f"child verdict {verdict!r}"
    # the parent's session is intact, and its next results are its own
    assert ref.gather() == [16, 16]
    assert sess.run(square, 5) == [25, 25]
    assert not sess.closed


def fork_then_return(how: str) -> int:
    """Fork a child that, a moment later, returns or exits the usual way: into the worker's
    own loop, which must not take it for the worker."""
    pid = os.fork()
    if pid == 0:
        time.sleep(0.2)
        if how == "exit":
            sys.exit(0)
        return -1  # returns from the call, in the child
    return pid


@pytest.mark.parametrize("how", ["exit", "return"])
def test_a_child_forked_by_a_call_ends_where_the_call_ends(make_session, how):
    """Before, the child answered on its parent's channel and went on serving as a second
    copy of the worker: a healthy worker was killed for a broken reply ring, or the replies
    were out of step."""
    sess = make_session(2)
    children = sess.run(fork_then_return, how, timeout=30)
    assert all(c > 0 for c in children)
    time.sleep(0.5)  # the children have come back by now
    for _ in range(3):
        assert sess.run(unison.rank, timeout=30) == [0, 1]


def big(value):
    import numpy as np

    return np.full(1 << 16, float(value))  # 512 KiB: on a reply block, not in the ring


def keep(a):
    _KEPT.append(a)


def kept_values():
    return float(_KEPT[-1].min()), float(_KEPT[-1].max())


def drop_in_a_child():
    """Fork a child that drops its copy of the kept arrays and leaves (as a worker's
    function may, for a helper process)."""
    pid = os.fork()
    if pid == 0:
        _KEPT.clear()
        import gc

        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)


_KEPT: list = []


@FORKS_ON_PURPOSE
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_that_drops_a_fetched_array_leaves_the_parents_intact(sess):
    """A fetched array lies on its worker's reply block, which goes back to the worker
    once the array is unmapped. A forked child inherits the mapping and its finalizer: it
    counted the block done when it dropped its copy, so the worker wrote its next replies
    over the parent's array, which changed with no error."""
    a = sess.call(big, 1).get(0)
    pid = os.fork()
    if pid == 0:
        del a
        import gc

        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    for i in range(10):
        sess.run(big, 100 + i)
    assert (float(a.min()), float(a.max())) == (1.0, 1.0)


@FORKS_ON_PURPOSE
def test_a_child_a_worker_forks_that_drops_an_argument_leaves_the_workers_intact(sess):
    """The same on a worker: an argument array it keeps lies on the command arena; a child
    it forked dropped its copy and counted the block, and a later argument landed under the
    kept array."""
    import numpy as np

    sess.run(keep, np.full(1 << 16, 1.0))
    sess.run(np.sum, np.zeros(1 << 16))  # (the loop holds a call's arguments until the next)
    sess.run(drop_in_a_child)
    for i in range(5):
        sess.run(np.sum, np.full(1 << 16, 50.0 + i))
    assert sess.run(kept_values) == [(1.0, 1.0)] * 2


def test_another_sessions_shared_array_is_refused_not_copied(make_session):
    """A sess.empty array travels by reference to its own session's workers. Passed to
    another session, it went as a copy, and the workers' writes were lost in silence."""
    import numpy as np

    first, second = make_session(2), make_session(2)
    shared = first.empty(1 << 14)
    shared[:] = 0
    with pytest.raises(ValueError, match="another session"):
        second.run(np.copyto, shared, 7.0)
    assert second.run(square, 3) == [9, 9]  # the session goes on
    first.run(np.copyto, shared, 7.0)
    assert shared[0] == 7.0
