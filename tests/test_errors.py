"""A worker's function raises: WorkerError, with the rank, the remote traceback and the
original exception as its cause; the session stays usable; every error is reported once."""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import threading

import pytest

import unison
from unison import CollectiveError, WorkerDied, WorkerError


class CustomError(Exception):
    """An exception type of the user's own, with extra state."""

    def __init__(self, code, text):
        super().__init__(code, text)
        self.code = code
        self.text = text


class HoldsALock(Exception):
    """An exception that cannot be pickled: it holds a lock."""

    def __init__(self):
        super().__init__("this exception holds a lock")
        self.lock = threading.Lock()


class CannotRebuild(Exception):
    """An exception that pickles but cannot be rebuilt from its args."""

    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


class BrokenStr(Exception):
    """An exception whose str() itself raises."""

    def __str__(self):
        raise RuntimeError("str() of this exception fails")


def boom(message="boom from the worker"):
    raise ValueError(message)


def fail_on(ranks):
    if unison.rank() in ranks:
        raise KeyError(f"rank {unison.rank()} failed")
    return unison.rank()


def raise_custom():
    raise CustomError(42, "custom text")


def raise_unpicklable():
    raise HoldsALock()


def raise_cannot_rebuild():
    raise CannotRebuild(1, 2)


def raise_broken_str():
    raise BrokenStr()


def exit_now():
    sys.exit(5)


def use(x):
    return x


# -- what a WorkerError carries ----------------------------------------------------------------


def test_a_raising_function_gives_worker_error_with_the_lowest_rank(sess):
    with pytest.raises(WorkerError) as info:
        sess.run(boom)
    err = info.value
    assert err.worker == 0
    assert sorted(err.errors) == [0, 1]
    assert all(isinstance(e, ValueError) for e in err.errors.values())


def test_the_message_carries_the_remote_traceback(sess):
    with pytest.raises(WorkerError) as info:
        sess.call(boom).gather()
    text = str(info.value)
    assert "boom" in text  # the function's name, from the traceback
    assert 'raise ValueError(message)' in text  # the line that raised
    assert "boom from the worker" in text
    assert "Traceback" in text


def test_the_cause_is_the_original_exception(sess):
    with pytest.raises(WorkerError) as info:
        sess.run(boom, "precise message")
    cause = info.value.__cause__
    assert type(cause) is ValueError
    assert str(cause) == "precise message"


def test_when_several_ranks_raise_the_error_names_the_lowest_and_keeps_all(make_session):
    sess = make_session(4)
    with pytest.raises(WorkerError) as info:
        sess.run(fail_on, [1, 3])
    err = info.value
    assert err.worker == 1
    assert sorted(err.errors) == [1, 3]
    assert isinstance(err.errors[3], KeyError)
    assert "rank 3 failed" in str(err.errors[3])
    assert "rank 1 failed" in str(err.__cause__)


def test_where_a_failure_began_is_the_lowest_rank_whose_error_is_its_own():
    """Collectives' reports of a peer that failed in the same call point past themselves;
    a report of a peer that did not fail (it returned early, or died) is its own; where
    every error is such a report, the lowest rank."""
    from unison.session.api import _began

    left = lambda peer: CollectiveError(f"worker {peer} left the call", peer=peer)
    assert _began({0: left(2), 1: left(2), 2: ValueError("x")}) == 2
    assert _began({0: left(1), 1: left(3), 3: KeyError("y")}) == 3
    assert _began({0: left(5), 1: left(0)}) == 0  # 5 returned early: 0's report is its own
    assert _began({0: left(1), 1: left(0)}) == 0  # reports of each other: the lowest
    assert _began({1: ValueError("a"), 2: ValueError("b")}) == 1
    copy = pickle.loads(pickle.dumps(left(4)))  # as it crosses from the worker
    assert copy.peer == 4 and str(copy) == "worker 4 left the call"


def test_a_custom_exception_class_round_trips(sess):
    with pytest.raises(WorkerError) as info:
        sess.run(raise_custom)
    cause = info.value.__cause__
    assert type(cause) is CustomError
    assert (cause.code, cause.text) == (42, "custom text")


@pytest.mark.parametrize("fn", [raise_unpicklable, raise_cannot_rebuild])
def test_an_exception_that_cannot_cross_still_gives_a_worker_error(sess, fn):
    with pytest.raises(WorkerError) as info:
        sess.run(fn)
    err = info.value
    assert err.worker == 0
    text = str(err)
    assert ("HoldsALock" in text) or ("CannotRebuild" in text)
    assert isinstance(err.__cause__, BaseException)
    assert sess.run(unison.rank) == [0, 1]


def test_an_exception_whose_str_fails_still_gives_a_worker_error(sess):
    with pytest.raises(WorkerError) as info:
        sess.run(raise_broken_str)
    assert not isinstance(info.value, WorkerDied)
    assert "BrokenStr" in str(info.value)
    assert sess.run(unison.rank) == [0, 1]


class ReprFails:
    """A callable object whose repr() raises (as one with state not set up yet)."""

    def __call__(self):
        raise ValueError("bad input")

    def __repr__(self):
        return f"ReprFails({self.weights})"  # AttributeError


class StrExits(Exception):
    """An exception whose str() raises a BaseException."""

    def __str__(self):
        sys.exit(2)


class StrInterrupts(Exception):
    """An exception whose str() raises KeyboardInterrupt (user code: a worker process
    ignores SIGINT, so this is no Ctrl-C)."""

    def __str__(self):
        raise KeyboardInterrupt


class ReducesBroken:
    """A value whose pickling raises an exception whose str() raises."""

    def __reduce__(self):
        raise BrokenStr()


def raise_str_exits():
    raise StrExits("x")


def raise_str_interrupts():
    raise StrInterrupts("x")


def return_reduces_broken():
    return ReducesBroken()


def raise_with_a_local_str():
    class Text(str):  # pickles by reference only where its class imports: nowhere
        pass

    class SaysText(Exception):
        def __str__(self):
            return Text("said in a str subclass")

    raise SaysText()


@pytest.mark.parametrize("fn, says", [
    (ReprFails(), "ValueError: bad input (in <repr() of this ReprFails failed"),
    (raise_str_exits, "StrExits: <str() of this StrExits failed: SystemExit>"),
    (raise_str_interrupts, "StrInterrupts: <str() of this StrInterrupts failed: Keyboard"),
    (return_reduces_broken, "cannot be pickled back to the controller: BrokenStr: <str()"),
    (raise_with_a_local_str, "SaysText: said in a str subclass"),
], ids=["repr", "str-exits", "str-interrupts", "reduce", "str-subclass"])
def test_an_error_that_its_own_report_trips_over_is_a_worker_error_not_a_death(
        sess, fn, says):
    """The worker's error report never raises: a failing repr() of the callable or str()
    of the exception (even SystemExit, or KeyboardInterrupt from user code), or a str
    subclass of the script's, gives a WorkerError naming the rank and the function."""
    with pytest.raises(WorkerError) as info:
        sess.run(fn)
    assert not isinstance(info.value, WorkerDied)
    assert info.value.worker == 0 and sorted(info.value.errors) == [0, 1]
    assert says in str(info.value), str(info.value)
    assert sess.run(unison.rank) == [0, 1]
    ref = sess.call(fn)  # the same, held on the workers until a sync (or a get) asks
    with pytest.raises(WorkerError, match=r"\(in "):
        ref.get() if fn is return_reduces_broken else sess.sync()
    assert sess.sync() is None


def test_an_error_report_that_fails_outright_still_names_the_type(monkeypatch):
    """Failing all else, the packed error names the exception's type alone."""
    from unison import protocol

    def broken(*args, **kwargs):
        raise MemoryError("no room to report")

    monkeypatch.setattr(protocol, "_pack_error", broken)
    packed = protocol.pack_error(ValueError("x"), "f")
    assert packed[1:] == ("ValueError", "<this ValueError could not be reported: "
                          "MemoryError while packing it>", "", "f")
    back = protocol.unpack_error(packed)
    assert "ValueError" in str(back)
    with pytest.raises(KeyboardInterrupt):  # worker 0 inline: Ctrl-C is raised on
        monkeypatch.setattr(protocol, "_pack_error", _interrupted)
        protocol.pack_error(ValueError("x"), "f", interrupts=True)


def _interrupted(*args, **kwargs):
    raise KeyboardInterrupt


def run_script(script) -> str:
    """Run ``script`` as its own program (its classes and functions are ``__main__``'s, sent
    by value), in its folder; what it printed, once it exited 0."""
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ), cwd=script.parent)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_an_exception_class_defined_in_a_scripts_main_round_trips(tmp_path):
    script = tmp_path / "script_with_its_own_error.py"
    script.write_text(
        "import unison\n"
        "class MyError(Exception):\n"
        "    pass\n"
        "def fail():\n"
        "    raise MyError('raised in a worker')\n"
        "with unison.Session(2) as sess:\n"
        "    try:\n"
        "        sess.run(fail)\n"
        "    except unison.WorkerError as err:\n"
        "        print('caught', isinstance(err.__cause__, MyError), err.__cause__)\n"
    )
    assert "caught True raised in a worker" in run_script(script)


def test_a_script_class_method_passed_as_an_argument_names_its_file_and_line(tmp_path):
    """A method of the script's class that reaches the workers in an argument (not through
    the called function's globals): the remote traceback names the script's file and line.
    Before (issue 9, forty-ninth pass; an audit of what workers raise), it said
    File "<dynamic-code>" with no line."""
    script = tmp_path / "script_with_a_model.py"
    script.write_text(
        "import unison\n"
        "class Model:\n"
        "    def forward(self, x):\n"
        "        return 1 / x  # the failing line\n"
        "def call_forward(m):\n"
        "    return m.forward(0)\n"
        "with unison.Session(2) as sess:\n"
        "    try:\n"
        "        sess.run(call_forward, Model())\n"
        "    except unison.WorkerError as err:\n"
        "        print(str(err).split('Remote traceback')[1])\n"
    )
    out = run_script(script)
    assert f'File "{script}", line 4, in forward' in out, out
    assert "the failing line" in out and "dynamic-code" not in out


def raise_huge(chars):
    raise ValueError("x" * chars)


def test_an_error_of_a_huge_message_gives_a_short_worker_error(sess):
    """A worker's exception of a 10 MB message: the WorkerError's message cuts each line at
    1,000 characters, and its cause keeps the message whole. Before (issue 9, forty-ninth
    pass; an audit of what workers raise), the WorkerError's message was 20 MB."""
    with pytest.raises(WorkerError) as info:
        sess.run(raise_huge, 10_000_000)
    assert len(str(info.value)) < 20_000
    assert "more characters)" in str(info.value)
    assert str(info.value.__cause__) == "x" * 10_000_000


def test_an_exception_raised_by_a_lambda_names_it_and_its_line(sess):
    fn = lambda: 1 / 0
    with pytest.raises(WorkerError) as info:
        sess.run(fn)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    # A function sent by value has no source file on the worker, but the traceback still
    # names the function and the line that raised.
    assert "in <lambda>" in str(info.value)
    assert f"line {fn.__code__.co_firstlineno}" in str(info.value)


def test_worker_errors_can_be_pickled_with_their_details(sess):
    import pickle

    with pytest.raises(WorkerError) as info:
        sess.run(fail_on, [0, 1])
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is WorkerError
    assert copy.worker == 0
    assert sorted(copy.errors) == [0, 1]
    assert str(copy) == str(info.value)


def test_a_healthy_workers_value_of_a_partly_failed_call_can_be_fetched(sess):
    ref = sess.call(fail_on, [0])
    assert ref.get(worker=1) == 1
    # Worker 0's failure has not been fetched: it surfaces at the next sync.
    with pytest.raises(WorkerError) as info:
        sess.sync()
    assert info.value.worker == 0
    assert sess.sync() is None


# -- the session survives ----------------------------------------------------------------------


def test_the_session_stays_usable_and_other_objects_are_intact(sess):
    kept = sess.scatter(["zero", "one"])
    with pytest.raises(WorkerError):
        sess.run(boom)
    assert kept.gather() == ["zero", "one"]
    assert sess.run(use, kept) == ["zero", "one"]
    assert sess.sync() is None


def test_sys_exit_in_a_worker_function_is_a_worker_error_not_a_death(sess):
    with pytest.raises(WorkerError) as info:
        sess.run(exit_now)
    assert not isinstance(info.value, WorkerDied)
    assert isinstance(info.value.__cause__, SystemExit)
    assert sess.run(unison.rank) == [0, 1]


def test_keyboard_interrupt_raised_by_a_function_is_a_worker_error(sess):
    def interrupt():
        raise KeyboardInterrupt

    with pytest.raises(WorkerError) as info:
        sess.run(interrupt)
    assert isinstance(info.value.__cause__, KeyboardInterrupt)
    assert sess.run(unison.rank) == [0, 1]


# -- errors are reported once, and never lost --------------------------------------------------


def test_an_error_surfaces_at_the_first_fetch_and_not_again_at_sync(sess):
    ref = sess.call(boom)
    with pytest.raises(WorkerError):
        ref.gather()
    assert sess.sync() is None


def test_an_error_surfaces_at_get_and_not_again_at_sync(sess):
    ref = sess[0].call(boom)
    with pytest.raises(WorkerError):
        ref.get()
    assert sess.sync() is None


def test_an_error_raised_by_run_is_not_reported_again_at_sync(sess):
    with pytest.raises(WorkerError):
        sess.run(boom)
    assert sess.sync() is None


def test_an_unfetched_error_surfaces_at_the_next_sync_and_only_once(sess):
    ref = sess.call(boom, "nobody fetched this")
    with pytest.raises(WorkerError) as info:
        sess.sync()
    assert "nobody fetched this" in str(info.value)
    assert info.value.worker == 0
    assert sess.sync() is None
    assert sess.sync() is None
    del ref


def test_an_error_of_a_dropped_ref_is_not_lost(sess):
    sess.call(boom, "dropped at once")  # the Ref is dropped right away
    with pytest.raises(WorkerError) as info:
        sess.sync()
    assert "dropped at once" in str(info.value)
    assert sess.sync() is None


def test_an_error_on_one_view_surfaces_at_a_session_sync(make_session):
    sess = make_session(3)
    sess[2].call(boom, "only rank 2")
    with pytest.raises(WorkerError) as info:
        sess.sync()
    assert info.value.worker == 2
    assert sess.sync() is None


def test_several_unfetched_errors_are_each_reported_exactly_once(sess):
    sess.call(boom, "first failure")
    sess.call(boom, "second failure")
    seen = []
    for _ in range(5):
        try:
            sess.sync()
        except WorkerError as err:
            seen.append(str(err.__cause__))
        else:
            break
    assert sorted(seen) == ["first failure", "second failure"]
    assert sess.sync() is None


def test_a_failed_calls_ref_used_as_an_argument_fails_the_later_call(sess):
    bad = sess.call(boom, "upstream failure")
    later = sess.call(use, bad)
    with pytest.raises(WorkerError) as info:
        later.gather()
    assert "upstream failure" in str(info.value)
    # The upstream error itself is still there to fetch (or to surface at a sync).
    with pytest.raises(WorkerError):
        bad.gather()
    assert sess.sync() is None


def make_worker_only_object(path, module):
    sys.path.insert(0, path)
    return importlib.import_module(module).Thing()


def test_a_value_that_cannot_be_unpickled_on_the_controller_fails_at_get_saying_so(
    sess, tmp_path
):
    module = f"unison_test_worker_only_{os.getpid()}"
    (tmp_path / f"{module}.py").write_text("class Thing:\n    pass\n")
    ref = sess.call(make_worker_only_object, str(tmp_path), module)
    assert sess.sync() is None  # the call itself succeeded
    with pytest.raises((WorkerError, TypeError), match=r"(?i)unpickl|cannot be"):
        ref.get()
    with pytest.raises(WorkerError) as got:  # the controller's failure, titled as such
        sess.run(make_worker_only_object, str(tmp_path), module)
    text = str(got.value)
    assert text.startswith("worker 0's reply could not be read: TypeError: "), text
    assert "Traceback on the controller (worker 0's reply):" in text, text
    assert "Remote traceback" not in text and "(in unpickling" not in text, text
    assert sess.run(unison.rank) == [0, 1]
    assert sess.sync() is None


def fail_on_0_else_worker_only_object(path, module):
    if unison.rank() == 0:
        raise ValueError("rank 0 really failed")
    return make_worker_only_object(path, module)


def test_a_value_that_cannot_be_unpickled_hides_no_other_ranks_error(sess, tmp_path):
    """One rank's value that will not unpickle on the controller is that rank's error, and
    the other ranks' replies are still read: one WorkerError with every failed rank (before,
    the TypeError came first and rank 0's error was never raised, nor seen by sync)."""
    module = f"unison_test_worker_only_{os.getpid()}"
    (tmp_path / f"{module}.py").write_text("class Thing:\n    pass\n")
    args = (fail_on_0_else_worker_only_object, str(tmp_path), module)
    with pytest.raises(WorkerError, match="rank 0 really failed") as ran:
        sess.run(*args)
    ref = sess.call(*args)
    with pytest.raises(WorkerError, match="rank 0 really failed") as got:
        ref.gather()
    for info in (ran, got):
        errors = info.value.errors
        assert sorted(errors) == [0, 1]
        assert isinstance(errors[0], ValueError)
        assert isinstance(errors[1], TypeError)
        assert "worker 1 cannot be unpickled on the controller" in str(errors[1])
        assert module in str(errors[1])  # why: the module that will not import here
    assert sess.sync() is None  # each error raised once
    assert sess.run(unison.rank) == [0, 1]


def test_a_function_that_captures_the_session_says_so(sess):
    """Pickle's own error named a '_thread.lock' inside the session, not the session (an
    audit, issue 9, forty-seventh pass)."""
    view = sess[0]
    for fn in (lambda: sess.run(unison.rank), lambda: view.run(unison.rank)):
        with pytest.raises(TypeError, match="cannot travel to the workers"):
            sess.run(fn)
    assert sess.run(unison.rank) == [0, 1]


class _ExitsWhenRebuilt:
    """Rebuilt on the controller by sys.exit(0) where a worker other than 0 made it."""

    def __reduce__(self):
        return (sys.exit, (0,)) if unison.rank() == 1 else (int, (5,))


def test_a_reply_whose_unpickling_raises_system_exit_is_that_ranks_error(sess):
    """SystemExit (a BaseException) from rebuilding a reply went straight out of get,
    gather and run: uncaught, the controller exited with status 0 and no word, and rank 0's
    good value was lost (an audit, issue 9, forty-seventh pass). It is that rank's
    TypeError now, as any reply that will not unpickle here."""
    for fetch in (lambda: sess.call(_ExitsWhenRebuilt).gather(),
                  lambda: sess.run(_ExitsWhenRebuilt)):
        with pytest.raises(WorkerError, match=r"cannot be unpickled on the controller: "
                                              r"SystemExit\(0\)") as info:
            fetch()
        assert sorted(info.value.errors) == [1]
    assert sess.run(unison.rank) == [0, 1]


def _exits_off_a_worker(message):
    """Rebuilds an _ExitsOffAWorker on a worker; exits (SystemExit) on the controller."""
    try:
        unison.rank()
    except RuntimeError:
        sys.exit(0)
    return _ExitsOffAWorker(message)


class _ExitsOffAWorker(Exception):
    def __reduce__(self):
        return (_exits_off_a_worker, (str(self),))


def raise_exits_off_a_worker():
    raise _ExitsOffAWorker(f"raised on {unison.rank()}")


def test_an_exception_whose_rebuilding_raises_system_exit_is_a_remote_error(sess):
    """A worker's exception whose rebuilding on the controller raised SystemExit let it out
    of run and sync: the ranks' errors were lost, and an uncaught one ended the script with
    status 0 and no word (an audit, issue 9, forty-ninth pass). It stands in as a
    RemoteError now, as an exception whose class does not import here."""
    with pytest.raises(WorkerError) as info:
        sess.run(raise_exits_off_a_worker)
    assert sorted(info.value.errors) == [0, 1]
    cause = info.value.__cause__
    assert type(cause) is unison.RemoteError
    assert (cause.type_name, cause.message) == ("_ExitsOffAWorker", "raised on 0")
    sess.call(raise_exits_off_a_worker)
    with pytest.raises(WorkerError, match="raised on 0") as info:
        sess.sync()
    assert sorted(info.value.errors) == [0, 1]
    assert sess.sync() is None
    assert sess.run(unison.rank) == [0, 1]


def test_a_value_that_cannot_be_pickled_back_fails_at_get_saying_so(sess):
    ref = sess.call(threading.Lock)
    assert sess.sync() is None  # the call itself succeeded
    with pytest.raises((WorkerError, TypeError), match=r"(?i)cannot be pickled") as got:
        ref.get()
    said = str(got.value) + str(got.value.__cause__)
    assert f"Ref #{ref._id}" in said and "pass the Ref to the calls that use it" in said, said
    with pytest.raises((WorkerError, TypeError), match=r"(?i)cannot be pickled") as got:
        sess.run(threading.Lock)
    said = str(got.value) + str(got.value.__cause__)
    assert "the result of" in said and "sess.call gives a Ref" in said, said
    # The object is still on the workers and usable there.
    assert sess.run(lambda lock: lock.acquire(blocking=False), ref) == [True, True]
    assert sess.run(unison.rank) == [0, 1]


class RebuildsBadly:
    """Pickles, and raises as the worker rebuilds it."""

    def __reduce__(self):
        return (raise_cannot_rebuild, ())


def test_each_error_names_the_step_it_came_from(sess):
    with pytest.raises(WorkerError, match=r"\(in use's arguments\)"):
        sess.run(use, RebuildsBadly())
    with pytest.raises(WorkerError, match=r"\(in Lock\)|\(in allocate_lock\)"):
        sess.run(threading.Lock)  # its result would not pickle: the function's step
    with pytest.raises(WorkerError, match=r"\(in get\)"):
        sess.call(threading.Lock).get()  # a Ref's value would not: the get's
    assert sess.run(use, 3) == [3, 3]


# -- exceptions that plain pickle cannot rebuild ---------------------------------------------


def test_an_exception_whose_init_does_not_take_its_args_back_arrives_as_itself(sess):
    with pytest.raises(WorkerError) as info:
        sess.run(raise_cannot_rebuild)
    cause = info.value.__cause__
    assert type(cause) is CannotRebuild
    assert str(cause) == "1/2"


def test_a_scripts_exception_with_a_non_trivial_init_arrives_with_its_attributes(tmp_path):
    script = tmp_path / "script_with_a_validation_error.py"
    script.write_text(
        "import unison\n"
        "class ValidationError(Exception):\n"
        "    def __init__(self, field, msg):\n"
        "        super().__init__(f'{field}: {msg}')\n"
        "        self.field = field\n"
        "def fail():\n"
        "    raise ValidationError('age', 'must be positive')\n"
        "with unison.Session(2) as sess:\n"
        "    try:\n"
        "        sess.run(fail)\n"
        "    except unison.WorkerError as err:\n"
        "        c = err.__cause__\n"
        "        print('caught', type(c) is ValidationError, c.field, '|', c)\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True, text=True, timeout=60, env=dict(os.environ), cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "caught True age | age: must be positive" in proc.stdout


def test_an_exception_with_an_attribute_that_cannot_cross_is_a_remote_error(sess):
    with pytest.raises(WorkerError) as info:
        sess.run(raise_unpicklable)
    cause = info.value.__cause__
    assert type(cause) is unison.RemoteError
    assert isinstance(cause, unison.UnisonError)
    assert cause.type_name == "HoldsALock"
    assert cause.message == "this exception holds a lock"
    assert "lock" in cause.attributes and "lock" in cause.attributes["lock"]
    assert "raise_unpicklable" in cause.traceback
    assert sess.run(unison.rank) == [0, 1]


def raise_from_a_module_only_the_worker_has(path):
    sys.path.insert(0, path)
    import only_on_this_worker  # the point: the controller cannot import it

    only_on_this_worker.fail()


def test_an_exception_whose_class_the_controller_cannot_import_is_a_remote_error(
    make_session, tmp_path
):
    (tmp_path / "only_on_this_worker.py").write_text(
        "class Unknown(Exception):\n"
        "    def __init__(self, detail):\n"
        "        super().__init__(f'detail is {detail}')\n"
        "        self.detail = detail\n"
        "def fail():\n"
        "    raise Unknown([1, 2])\n"
    )
    sess = make_session(1)
    with pytest.raises(WorkerError) as info:
        sess.run(raise_from_a_module_only_the_worker_has, str(tmp_path))
    cause = info.value.__cause__
    assert type(cause) is unison.RemoteError
    assert (cause.type_name, cause.message) == ("Unknown", "detail is [1, 2]")
    assert cause.attributes == {"detail": "[1, 2]"}
    assert "only_on_this_worker" in cause.traceback
    assert "RemoteError" in unison.__all__


def test_a_function_the_workers_cannot_load_fails_each_call_saying_why(
    make_session, tmp_path, monkeypatch
):
    """A function of a module only the controller can import (its folder joined sys.path
    after the workers started) fails to load on them: each call of it, by run or by call,
    is a WorkerError that says why and what to do; the session stays usable."""
    (tmp_path / "only_on_the_controller.py").write_text("def seven():\n    return 7\n")
    sess = make_session(2)
    monkeypatch.syspath_prepend(str(tmp_path))
    seven = importlib.import_module("only_on_the_controller").seven
    for _ in range(2):  # defined once, failing at every call
        with pytest.raises(WorkerError) as info:
            sess.run(seven)
        text = str(info.value)
        assert "could not be loaded on this worker" in text, text
        assert "only_on_the_controller" in text and "importable" in text, text
        assert "object at 0x" not in text, text  # it names what ran in words
        assert type(info.value.__cause__) is RuntimeError
    sess.call(seven)
    with pytest.raises(WorkerError, match="could not be loaded on this worker") as info:
        sess.sync()
    assert sorted(info.value.errors) == [0, 1]  # each worker's error, reported once
    sess.sync()
    assert sess.run(use, 3) == [3, 3]


class RefusedOnWorkers:
    """An object whose unpickling fails on a worker (its ``__setstate__`` raises there)."""

    def __init__(self):
        self.x = 1

    def __setstate__(self, state):
        raise RuntimeError(f"refused on worker {unison.rank()}")


def test_a_function_whose_capture_fails_to_load_says_why_without_import_advice(sess):
    """A script's function whose captured object will not unpickle on the workers: the
    error gives that object's own error, and where the load failed, not the advice to
    make a module importable. Before (an audit, issue 9, forty-ninth pass), it gave that
    advice for any failure, and the original's type and frames were lost."""
    held = RefusedOnWorkers()
    with pytest.raises(WorkerError) as info:
        sess.run(lambda: held.x)
    text = str(info.value)
    assert "could not be loaded on this worker: refused on worker 0 (RuntimeError" in text
    assert "importable" not in text, text
    assert "Where loading the function failed" in text and "__setstate__" in text, text
    assert sess.run(use, 3) == [3, 3]


def forge_the_reply() -> set[str]:
    """Worker code that meddles with unison's own channel: the reply this call sends
    carries another request's id. Its value is not plain (a set; a list of str is), so
    that the reply goes through ``chan.reply`` (a plain one may take the channel's
    one-step ``reply_plain``)."""
    import gc

    from unison import protocol
    from unison.channel import WorkerChannel

    chan = next(o for o in gc.get_objects() if isinstance(o, WorkerChannel))
    send = chan.reply

    def forged(data: bytes, buffers: object = ()) -> None:
        del chan.reply  # the next replies are the channel's own again
        send(protocol.dumps((987654321, protocol.OK, "forged")))

    chan.reply = forged  # type: ignore[method-assign]
    return {"real"}


def forge_a_plain_reply() -> str:
    """The same through the channel's one-step reply of a plain value, sent before the
    call's own."""
    import gc

    from unison import protocol
    from unison.channel import WorkerChannel

    chan = next(o for o in gc.get_objects() if isinstance(o, WorkerChannel))
    forged = (987654321, protocol.OK, "forged")
    if not chan.reply_plain(forged, protocol.PLAIN):
        chan.reply(protocol.dumps_plain(forged, protocol.PLAIN))
    return "real"


@pytest.mark.parametrize("forge,says", [
    (forge_the_reply, "answered request 987654321 where"),
    # two replies come, the forged one first: the session closes on it as an answer to
    # another request or as a reply nobody waits for, as the timing falls (both seen)
    (forge_a_plain_reply,
     "answered request 987654321 where|sent a reply that no request was waiting for"),
], ids=["reply", "plain"])
def test_a_run_whose_reply_carries_another_id_closes_the_session(make_session, forge, says):
    """Taking the forged reply for the run's own would be a wrong result in silence."""
    sess = make_session(2)
    assert sess.run(unison.rank) == [0, 1]
    with pytest.raises(unison.SessionClosed, match=says):
        sess.run(forge)
    assert sess.closed


def fail_late():
    import time

    time.sleep(0.2 + 0.2 * unison.rank())
    raise ValueError(f"boom on worker {unison.rank()}")


def test_a_get_of_one_worker_leaves_the_others_late_error_for_sync(sess):
    """A get of worker 0 timed out: its late error is kept for the next sync. Then a get of
    worker 1 raised worker 1's error and forgot the call's errors on every worker, so no
    sync ever raised worker 0's, and the close said nothing of it."""
    ref = sess.call(fail_late)
    with pytest.raises(TimeoutError):
        ref.get(worker=0, timeout=0.05)
    with pytest.raises(WorkerError) as got:
        ref.get(worker=1)
    assert got.value.worker == 1
    with pytest.raises(WorkerError, match="boom on worker 0") as synced:
        sess.sync()
    assert synced.value.worker == 0
    sess.sync()  # raised once


def fail_now():
    raise ValueError("B's call failed")


def test_a_sync_raises_no_error_of_a_call_sent_after_it_began(sess, monkeypatch):
    """Thread A's sync is under way when thread B sends a call that fails, then syncs. A's
    sync raised B's error (the earliest held), and B's own sync returned quietly: B never
    learned its call failed. Here B's call goes out from inside A's sync, where A asks the
    workers for their errors (the shm channel's count, or a SYNC)."""
    sess.run(unison.rank)
    chan = sess._chan
    sent: list[unison.Ref] = []

    def b_sends() -> None:
        if not sent:
            sent.append(sess.call(fail_now))  # thread B, in the middle of A's sync
            sess.run(unison.rank)  # (B's call has run)

    def before(obj, name):
        real = getattr(obj, name)

        def first_b(*args, **kwargs):
            b_sends()
            return real(*args, **kwargs)

        monkeypatch.setattr(obj, name, first_b)

    before(chan, "unreported")
    before(sess, "_request")
    monkeypatch.setattr(chan, "settled", lambda ranks, timeout: False)  # A asks
    sess.call(unison.rank)
    sess.sync()  # A's: B's call was sent after it began
    monkeypatch.undo()
    assert sent
    with pytest.raises(WorkerError, match="B's call failed"):
        sess.sync()  # B's
