"""Bad arguments are refused at once, on the controller, with ValueError or TypeError that
say what was wrong; nothing is sent and the session stays usable."""

from __future__ import annotations

import gc
import threading
import time

import pytest

import unison
from support import open_fds
from unison import SessionClosed


def echo(*args, **kwargs):
    return args, kwargs


# -- Session(...) ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -1])
def test_num_workers_below_one_is_a_value_error(n):
    with pytest.raises(ValueError, match=f"num_workers must be at least 1, got {n}"):
        unison.Session(n)


@pytest.mark.parametrize("n", [2.0, "2", None, True])
def test_num_workers_that_is_not_an_int_is_a_type_error(n):
    with pytest.raises(TypeError, match="num_workers must be an int"):
        unison.Session(n)


@pytest.mark.parametrize("n", [4097, 10**10])
def test_num_workers_past_the_bound_is_a_value_error_at_once_and_leaks_nothing(n):
    # before, 10**10 built a per-rank CPU plan of 10**10 entries (the controller's memory
    # filled); 10**6 failed late, fds left open
    gc.collect()
    before = open_fds()
    t = time.monotonic()
    with pytest.raises(ValueError, match="4096 one session takes"):
        unison.Session(n)
    assert time.monotonic() - t < 1.0
    assert open_fds() == before


@pytest.mark.parametrize("n, groups, said", [
    (4, 3, "divisible by num_groups"), (3, 2, "divisible by num_groups"),
    (2, 0, "num_groups must be at least 1"), (2, -1, "num_groups must be at least 1"),
])
def test_num_workers_not_divisible_by_num_groups_is_a_value_error(n, groups, said):
    with pytest.raises(ValueError, match=said):
        unison.Session(n, num_groups=groups)


def test_an_unknown_launcher_is_a_value_error():
    with pytest.raises(ValueError, match="unknown launcher 'no-such-launcher': use one of"):
        unison.Session(1, launcher="no-such-launcher")


@pytest.mark.parametrize("kw, said", [
    ({"env": {5: {"A": "1"}}}, r"env has key 5, which is not a rank in 0\.\.1"),
    ({"cpu_affinity": {7: [0]}}, r"cpu_affinity has key 7, which is not a rank in 0\.\.1"),
    ({"cpu_affinity": {0: [4096]}}, "cannot use"),  # a CPU this machine lacks
    ({"cpu_affinity": {0: []}}, "cannot use"),
])
def test_settings_for_a_rank_that_does_not_exist_are_a_value_error_and_leak_nothing(kw, said):
    gc.collect()
    before = open_fds()
    with pytest.raises(ValueError, match=said):
        unison.Session(2, **kw)
    gc.collect()
    leaked = open_fds() - before
    assert not leaked, f"a refused Session left these open: {sorted(leaked)}"


# -- ranks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [2, 3, -3, 100])
def test_a_worker_index_out_of_range_is_an_index_error_like_a_sequence(sess, index):
    with pytest.raises(IndexError):
        sess[index]


def test_iterating_a_session_or_view_gives_one_view_per_worker_and_ends(make_session):
    sess = make_session(3)
    assert [v.workers for v in sess] == [(0,), (1,), (2,)]
    assert [v.workers for v in sess[1:]] == [(1,), (2,)]
    assert list(sess[0]) and len(list(sess)) == 3


def test_numpy_integer_ranks_are_accepted_like_ints(make_session):
    import numpy as np

    sess = make_session(4, num_groups=2)
    assert sess[np.int64(1)].workers == (1,)
    assert sess.group(np.int32(1)).workers == (2, 3)
    ref = sess.call(unison.rank)
    assert ref.get(worker=np.uint8(3)) == 3
    assert sess.run(unison.rank)[np.int64(2)] == 2


def test_indexing_with_something_else_is_a_type_error(sess):
    with pytest.raises(TypeError):
        sess["0"]
    with pytest.raises(TypeError):
        sess[1.0]


def test_an_empty_slice_is_a_value_error(sess):
    with pytest.raises(ValueError):
        sess[2:5]


@pytest.mark.parametrize("g", [2, -1])
def test_a_group_out_of_range_is_a_value_error(make_session, g):
    sess = make_session(4, num_groups=2)
    with pytest.raises(ValueError):
        sess.group(g)


@pytest.mark.parametrize("worker", [2, 5, 100])
def test_get_from_a_worker_out_of_range_is_a_value_error(sess, worker):
    ref = sess.put(1)
    with pytest.raises(ValueError):
        ref.get(worker=worker)
    assert ref.get(worker=1) == 1


def test_get_from_a_worker_named_by_something_other_than_an_int_is_a_type_error(sess):
    ref = sess.put(1)
    with pytest.raises(TypeError):
        ref.get(worker="1")
    with pytest.raises(TypeError):
        ref.get(worker=True)


# -- scatter -----------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[], [1], [1, 2, 3]])
def test_scatter_with_the_wrong_number_of_values_is_a_value_error(sess, values):
    with pytest.raises(ValueError):
        sess.scatter(values)
    assert sess.run(unison.rank) == [0, 1]


# -- values that cannot be pickled -------------------------------------------------------------


def test_an_unpicklable_argument_is_a_type_error_naming_its_position(sess):
    with pytest.raises(TypeError, match="argument 1"):
        sess.call(echo, "fine", threading.Lock())
    assert sess.run(unison.rank) == [0, 1]


def test_an_unpicklable_keyword_argument_is_a_type_error_naming_it(sess):
    with pytest.raises(TypeError, match="keyword argument 'x'"):
        sess.call(echo, 1, x=threading.Lock())
    assert sess.run(unison.rank) == [0, 1]


def test_an_unpicklable_value_to_put_or_scatter_is_a_type_error(sess):
    with pytest.raises(TypeError):
        sess.put(threading.Lock())
    with pytest.raises(TypeError, match="1"):
        sess.scatter([1, threading.Lock()])
    assert sess.run(unison.rank) == [0, 1]


def test_an_unpicklable_function_is_a_type_error(sess):
    lock = threading.Lock()

    def holds_a_lock():
        return lock.locked()

    with pytest.raises(TypeError):
        sess.call(holds_a_lock)
    assert sess.run(unison.rank) == [0, 1]


# -- Refs that cannot be used here -------------------------------------------------------------


def test_a_ref_from_another_session_is_a_value_error(make_session):
    one, other = make_session(2), make_session(2)
    foreign = other.put(1)
    with pytest.raises(ValueError):
        one.call(echo, foreign)
    with pytest.raises(ValueError):
        one.call(echo, k=[foreign])
    assert one.run(unison.rank) == [0, 1]
    assert foreign.gather() == [1, 1]


def test_a_ref_from_a_closed_session_is_refused(make_session):
    one, other = make_session(2), make_session(2)
    stale = other.put(1)
    other.close()
    with pytest.raises(ValueError):
        one.call(echo, stale)
    with pytest.raises(SessionClosed):
        stale.get()
    assert one.run(unison.rank) == [0, 1]


def test_a_freed_ref_passed_to_a_call_is_a_value_error(sess):
    ref = sess.put(1)
    ref.free()
    with pytest.raises(ValueError):
        sess.call(echo, ref)
    assert sess.run(unison.rank) == [0, 1]


def test_fetching_a_freed_ref_is_a_value_error(sess):
    ref = sess.put(1)
    ref.free()
    with pytest.raises(ValueError):
        ref.get()
    with pytest.raises(ValueError):
        ref.gather()


def test_a_ref_cannot_be_pickled_outside_a_call(sess):
    import pickle

    ref = sess.put(1)
    with pytest.raises(TypeError):
        pickle.dumps(ref)


# -- functions and timeouts --------------------------------------------------------------------


@pytest.mark.parametrize("fn", [42, "unison.rank", None])
def test_a_non_callable_fn_is_a_type_error(sess, fn):
    with pytest.raises(TypeError):
        sess.call(fn)
    with pytest.raises(TypeError):
        sess.run(fn)
    with pytest.raises(TypeError):
        sess[0].call(fn)
    assert sess.run(unison.rank) == [0, 1]


def test_a_negative_timeout_is_a_value_error(sess):
    ref = sess.put(1)
    with pytest.raises(ValueError):
        ref.get(timeout=-1)
    with pytest.raises(ValueError):
        ref.gather(timeout=-0.5)
    with pytest.raises(ValueError):
        sess.sync(timeout=-1)
    with pytest.raises(ValueError):
        sess.run(unison.rank, timeout=-1)
    assert ref.gather(timeout=10) == [1, 1]
    assert sess.run(unison.rank) == [0, 1]


@pytest.mark.parametrize("variables", [
    {"A=B": "1"}, {"": "1"}, {"A\0": "1"}, {"A": "x\0y"},
    {"UNISON_LOG_LEVELS": "[1]"}, {"UNISON_LOG_LEVELS": '{"": "loud"}'},
    {"UNISON_LOG_LEVELS": "garbage"}, {"UNISON_PURE": "maybe"},
])
def test_env_variables_no_process_can_hold_are_refused_before_any_worker_starts(variables):
    # before, the worker died at start with a traceback (WorkerDied), or, for log levels
    # that are not JSON, ignored them in silence
    before = open_fds()
    with pytest.raises(ValueError, match=r"env\[1\]"):
        unison.Session(2, env={1: variables})
    assert open_fds() == before


@pytest.mark.parametrize("value", ["no", 1, None])
def test_inline_worker0_that_is_not_a_bool_is_a_type_error(value):
    with pytest.raises(TypeError, match="True or False"):  # before, "no" ran worker 0 inline
        unison.Session(2, inline_worker0=value)


@pytest.mark.parametrize("env", [{0: "A=1"}, {0: ["A", "1"]}, {0: None}, {"0": {"A": "1"}}])
def test_env_values_that_are_not_mappings_are_refused_before_any_worker_starts(env):
    before = open_fds()
    with pytest.raises((TypeError, ValueError),
                       match=r"must be a dict of environment variables|env has key '0'"):
        unison.Session(2, env=env)
    gc.collect()
    assert not open_fds() - before


@pytest.mark.parametrize("shape", [(-3,), -1, (2, -1), (2.5,), "3"])
def test_empty_with_a_bad_shape_is_refused(sess, shape):
    with pytest.raises((TypeError, ValueError)):
        sess.empty(shape)
    assert sess.empty((2, 0)).shape == (2, 0)
    assert sess.empty(3).shape == (3,)


@pytest.mark.parametrize("values", [{0: "a", 1: "b"}, {"a", "b"}, "ab", b"ab"])
def test_scatter_of_a_dict_set_or_string_is_a_type_error(sess, values):
    with pytest.raises(TypeError, match="one per worker"):
        sess.scatter(values)
    with pytest.raises(TypeError, match="one per worker"):
        sess.scatter_from(values)
    assert sess.scatter(("a", "b")).gather() == ["a", "b"]


@pytest.mark.parametrize("shape", [(4, (1 << 62) + 1), ((1 << 32) + 1, 1 << 32), (1 << 32,) * 2])
def test_empty_of_more_bytes_than_an_array_can_hold_says_so(sess, shape):
    """numpy's int64 product of the shape wrapped: a shape of 2**64 + 4 elements took 4,
    allocated them, then failed in numpy's reshape; one of 2**64 + 2**32 reported a
    MemoryError for 32 GiB. Now the true size is refused up front."""
    with pytest.raises(ValueError, match="more than any array can"):
        sess.empty(shape)
    assert sess.empty(3).shape == (3,)


# -- an audit of bad input (issue 9, forty-seventh pass) ---------------------------------------


def test_numpy_integer_sizes_start_a_session(make_session):
    """Every rank argument takes a numpy integer; the sizes said "must be an int, got
    int64". A float or a bool is still refused."""
    import numpy as np

    sess = make_session(np.int64(2), num_groups=np.int32(1))
    assert sess.run(unison.rank) == [0, 1] and type(sess.num_workers) is int
    for bad in (2.0, True):
        with pytest.raises(TypeError, match="num_workers must be an int"):
            unison.Session(bad)


def test_timeouts_that_take_no_none_do_not_offer_it(make_session):
    """close and stacks said "must be a number of seconds or None, got NoneType"."""
    sess = make_session(2)
    for fn in (sess.stacks, sess.close):
        with pytest.raises(TypeError, match=r"number of seconds, got NoneType"):
            fn(timeout=None)
    with pytest.raises(TypeError, match=r"number of seconds or None, got str"):
        sess.sync(timeout="1")


def test_a_shared_array_of_python_objects_says_why_not(make_session):
    sess = make_session(2)
    for dtype in (object, [("a", "f8"), ("b", "O")]):
        with pytest.raises(TypeError, match="holds bytes, not Python objects"):
            sess.empty(4, dtype)
    assert sess.empty(4, "f8").shape == (4,)


def test_a_connect_launcher_checks_its_port_and_bind_when_made():
    """A port past 65535 raised OverflowError at the session's start; bind=5 a bare
    TypeError there."""
    from unison.launch.connect import ConnectLauncher

    for port in (70000, -1, "80", True):
        with pytest.raises(ValueError, match="port must be an int from 0"):
            ConnectLauncher(port=port, secret=bytes(16))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bind must be a host"):
        ConnectLauncher(bind=5, secret=bytes(16))  # type: ignore[arg-type]


def test_demo_workers_below_one_says_so():
    from unison.demo.app import layout

    for n in (0, -1):
        with pytest.raises(ValueError, match="--workers must be at least 1"):
            layout(n, None, 1)


def test_a_worker_given_a_secret_that_is_not_hex_says_so():
    import os
    import subprocess
    import sys

    env = dict(os.environ, UNISON_SECRET="not-hex-at-all")
    done = subprocess.run([sys.executable, "-m", "unison", "worker", "--connect",
                           "127.0.0.1:9"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "not the hex of 16 bytes or more" in done.stderr


def test_torch_collectives_without_torch_say_which_extra_before_any_worker_starts(monkeypatch):
    """Without torch the session started, and its first collective raised a worker's
    ModuleNotFoundError (an audit of the packaging, issue 9, forty-seventh pass)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    before = open_fds()
    with pytest.raises(ImportError, match=r"pip install 'unison\[torch\]'"):
        unison.Session(2, collectives="torch")
    assert open_fds() == before
