"""The session's function cache remembers the last function it found (issue 9's hot path):
never past the moment its copy on the workers may be gone or stale."""

from __future__ import annotations

import functools
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import cloudpickle
import pytest

import unison
from unison.protocol import define_msg
from unison.session import api, fncache
from unison.session.fncache import FunctionCache


def first() -> int:
    return 1


def second() -> int:
    return 2


def third() -> int:
    return 3


def test_the_last_function_found_is_remembered_only_while_its_copy_is_current() -> None:
    cache = FunctionCache(size=2)
    assert cache.store(first, 1, *cache.pickle(first))[0] == []
    assert cache.last is None  # stored is not found: the send that defined it looks again
    assert cache.lookup(first) == (1, None)
    assert (cache.last, cache.last_id) == (first, 1)
    assert cache.lookup(second) == (0, None)  # a miss forgets it too
    assert cache.last is None
    assert cache.lookup(first) == (1, None)
    assert cache.store(second, 2, *cache.pickle(second))[0] == []
    assert cache.last is None  # a store may drop any entry
    assert cache.lookup(first) == (1, None)  # first is the most recent again: second goes
    assert cache.store(third, 3, *cache.pickle(third))[0] == [2]
    assert cache.lookup(second) == (0, None)
    assert cache.lookup(first) == (1, None)
    assert cache.store(second, 4, *cache.pickle(second))[0] == [3]
    assert cache.lookup(first) == (1, None)
    assert cache.last is first


def test_a_function_sent_by_value_is_remembered_with_what_proves_its_copy_current() -> None:
    cache = FunctionCache()
    box, size = [1], 2

    def mutable() -> int:  # compared by its pickle at each lookup: never remembered
        return box[0]

    def planned() -> int:  # its captures checked by identity: remembered with its plan
        return size

    cache.store(mutable, 1, *cache.pickle(mutable))
    assert cache.lookup(mutable) == (1, None)
    assert cache.last is None
    cache.store(planned, 2, *cache.pickle(planned))
    assert cache.lookup(planned) == (2, None)
    assert cache.last is planned and cache.last_plan is not None and cache.last_plan.holds()
    size = 3  # the session's send tests the plan: it no longer holds, and a lookup misses
    assert not cache.last_plan.holds()
    assert cache.lookup(planned) == (0, None)
    assert cache.last is None
    assert planned() == 3


def test_a_script_function_whose_capture_changed_is_sent_again(
    make_session: Callable[..., unison.Session],
) -> None:
    sess = make_session(2)
    scale = 2

    def scaled(x: int) -> int:
        return x * scale

    for _ in range(3):  # the quick send finds it last, and its plan holding
        assert sess.run(scaled, 5) == [10, 10]
    scale = 7
    assert sess.run(scaled, 5) == [35, 35]
    assert scaled(1) == 7


def _copies_of(name: str) -> int:
    """On a worker: how many function objects named ``name`` it holds."""
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects()
               if isinstance(o, types.FunctionType) and o.__name__ == name)


def test_warnings_as_errors_a_large_capture_sent_again_leaves_one_copy_on_the_workers(
    make_session: Callable[..., unison.Session], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under -W error the warning about a large capture sent again was raised between
    forgetting the old definition and remembering the new one: neither id was ever freed,
    and each such re-send left a copy on every worker for good. Now both are done first."""
    monkeypatch.setattr(fncache, "BIG_CAPTURE", 10)  # every re-send is "large"
    sess = make_session(1)
    data = [1, 2, 3]

    def reads_data() -> int:
        return data[-1]

    assert sess.run(reads_data) == [3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            data.append(i)
            try:
                sess.run(reads_data)
            except RuntimeWarning:
                assert i == 0  # warned once per function
    assert sess.run(reads_data) == [2]
    sess.sync()  # the frees ride on the messages after them
    sess.run(_copies_of, "reads_data")
    assert sess.run(_copies_of, "reads_data") == [1]


def test_a_capture_rebound_while_its_define_waits_is_seen_at_the_next_call(
    make_session: Callable[..., unison.Session], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread rebinds what a function captures while its DEFINE waits for room in
    the ring (injected in the send itself): the proof of the workers' copy was taken after
    the send, from the new value, beside a pickle of the old one, and every later call ran
    the stale copy."""
    sess = make_session(2)
    scale = 1

    def scaled() -> int:
        return scale

    real = sess._send

    def rebinding(build: Callable[..., bytes], *args: Any, **kwargs: Any) -> None:
        nonlocal scale
        if build is define_msg and scale == 1:
            scale = 2
        real(build, *args, **kwargs)

    monkeypatch.setattr(sess, "_send", rebinding)
    sess.run(scaled)  # sent with 1 (the call and the rebinding raced: either is right)
    assert sess.run(scaled) == [2, 2]
    assert sess.run(scaled) == [2, 2]


def test_a_capture_rebound_after_the_lookup_made_its_pickle_is_seen_at_the_next_call(
    make_session: Callable[..., unison.Session], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same, where the lookup compared the pickles (a list captured) and handed its
    pickle to the DEFINE, and the capture then became an int: the proof was a plan of the
    int, and the workers kept the list."""
    sess = make_session(2)
    box: object = [1]

    def read() -> object:
        return box

    assert sess.run(read) == [[1], [1]]
    box = [2]
    real = sess._define

    def rebinding(fn: Callable[..., Any], blob: bytes | None, *args: Any) -> tuple[int, bool]:
        nonlocal box
        if blob is not None:  # another thread, between the lookup's pickle and the DEFINE
            box = 3
        return real(fn, blob, *args)

    monkeypatch.setattr(sess, "_define", rebinding)
    sess.run(read)
    assert sess.run(read) == [3, 3]


def test_keyword_only_defaults_set_or_changed_after_the_first_call_are_seen(
    make_session: Callable[..., unison.Session],
) -> None:
    """The plan that proves a copy current checked __defaults__ but not __kwdefaults__: one
    set after the first call, or an empty dict filled in place, never reached the workers
    (they raised TypeError for the missing argument where a local call worked)."""
    sess = make_session(2)

    def kwo(*, a: int) -> int:
        return a

    assert sess.run(kwo, a=3) == [3, 3]
    assert sess.run(kwo, a=4) == [4, 4]
    kwo.__kwdefaults__ = {"a": 9}
    assert sess.run(kwo) == [9, 9]
    kwo.__kwdefaults__["a"] = 10
    assert sess.run(kwo) == [10, 10]

    def empty(*, a: int) -> int:
        return a

    empty.__kwdefaults__ = {}
    assert sess.run(empty, a=1) == [1, 1]
    empty.__kwdefaults__["a"] = 5
    assert sess.run(empty) == [5, 5]


@pytest.fixture
def small_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "_FN_CACHE", 2)


@pytest.mark.usefixtures("small_cache")
def test_a_function_called_again_after_the_cache_dropped_it_is_defined_again(
    make_session: Callable[..., unison.Session],
) -> None:
    sess = make_session(2)
    for _ in range(3):  # first is the last found: the quick send skips the lookup
        assert sess.run(first) == [1, 1]
        sess.call(first)
        sess.sync()
    assert sess.run(second) == [2, 2]
    assert sess.run(third) == [3, 3]  # the workers drop first's copy
    assert sess.run(first) == [1, 1]
    assert sess.run(first) == [1, 1]
    assert sess.run(second) == [2, 2]


_BOX = [1]


def _wrapped(fn: Callable[[], int]) -> Callable[[], int]:
    @functools.wraps(fn)
    def wrapper() -> int:
        return fn()

    return wrapper


def _reads_box() -> int:
    return _BOX[0]


_UNWRAPPED = _reads_box
_reads_box = _wrapped(_reads_box)  # the module's name now holds the wrapper


def test_a_function_its_module_holds_no_more_is_sent_by_value_and_kept_current(
        make_session: Callable[..., unison.Session]) -> None:
    """A function under a decorator's wrapper of the same name is not what its module holds
    under its name, so cloudpickle sends it by value, with the list it reads; the cache
    took it for one sent by reference and called the stale copy (workers read 1 after the
    list said 2)."""
    sess = make_session(2)
    assert sess.run(_UNWRAPPED) == [1, 1]
    _BOX[0] = 2
    try:
        assert sess.run(_UNWRAPPED) == [2, 2]
    finally:
        _BOX[0] = 1


class Named:
    """A class of an importable module: pickle sends it by name."""

    def __init__(self, x: int = 0) -> None:
        self.x = x


def _made_on_the_fly(value: int) -> type:
    """A class whose module does not hold it under its name: cloudpickle sends its body."""
    return type("Named", (), {"value": value, "__module__": __name__})


def test_a_class_sent_by_name_is_kept_and_one_made_on_the_fly_is_sent_every_time() -> None:
    cache = FunctionCache()
    assert cache.cacheable(Named) and cache.store(Named, 1, *cache.pickle(Named))[0] == []
    assert cache.lookup(Named) == (1, None)  # sess.call(Model, path): no DEFINE per call
    assert cache.cacheable(int)
    fly = _made_on_the_fly(1)
    assert not cache.cacheable(fly) and cache.store(fly, 2, *cache.pickle(fly))[0] == []
    assert cache.lookup(fly) == (0, None)


def _value_of(cls: type) -> int:
    return int(cls().value)


def test_a_session_defines_a_named_class_once_and_sees_a_changed_one_made_on_the_fly(
        make_session: Callable[..., unison.Session]) -> None:
    sess = make_session(2)
    defines = 0
    real = sess._define

    def counting(*args: object, **kwargs: object) -> tuple[int, bool]:
        nonlocal defines
        defines += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    sess._define = counting  # type: ignore[method-assign]
    for x in range(3):
        ref = sess.call(Named, x)
        assert [obj.x for obj in ref.gather()] == [x, x]
    assert defines == 1
    fly = _made_on_the_fly(1)
    assert sess.run(_value_of, fly) == [1, 1]
    fly.value = 2  # type: ignore[attr-defined]  # the same class object, changed
    refs = [sess.call(fly) for _ in range(2)]
    assert [o.value for o in refs[-1].gather()] == [2, 2]


def test_a_function_of_a_module_registered_to_go_by_value_is_kept_current(
    make_session: Callable[..., unison.Session], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cloudpickle sends the functions of a module registered with register_pickle_by_value
    by value, with its globals then; the cache took them for imports (always current) and
    the workers kept the first copy."""
    mod = types.ModuleType("unison_test_by_value")
    exec("DATA = [1]\nSCALE = 1\ndef total():\n    return sum(DATA) * SCALE\n", mod.__dict__)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    cloudpickle.register_pickle_by_value(mod)
    try:
        sess = make_session(2)
        assert sess.run(mod.total) == [1, 1]
        mod.DATA.append(10)
        assert sess.run(mod.total) == [11, 11]
        mod.SCALE = 100
        assert sess.run(mod.total) == [1100, 1100]
        # passed as an argument (or inside one), it went by reference: the standard
        # pickler names it, and the workers ran their own import (stale, or none here)
        assert sess.run(_call_it, mod.total) == [1100, 1100]
        mod.SCALE = 2
        assert sess.run(_call_it, [mod.total]) == [22, 22]
    finally:
        cloudpickle.unregister_pickle_by_value(mod)


def _call_it(fn: Any) -> Any:
    return (fn[0] if isinstance(fn, list) else fn)()


def test_a_module_not_in_sys_modules_that_a_function_reads_is_kept_current(
    make_session: Callable[..., unison.Session],
) -> None:
    """cloudpickle sends a module it cannot import on the other side (not in sys.modules) by
    value, its whole dict; the cache counted every module immutable."""
    sess = make_session(2)
    cfg = types.ModuleType("unison_test_cfg")
    cfg.scale = 1  # type: ignore[attr-defined]

    def read() -> int:
        return int(cfg.scale)  # type: ignore[attr-defined]

    assert sess.run(read) == [1, 1]
    cfg.scale = 2  # type: ignore[attr-defined]
    assert sess.run(read) == [2, 2]


def test_by_reference_is_cloudpickles_own_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A function goes by reference only where cloudpickle sends it so: not one of a module
    registered to go by value, nor of a module not in sys.modules; and where cloudpickle
    cannot say, by value (always right)."""
    registered = types.ModuleType("unison_test_registered")
    exec("def fn():\n    return 1\n", registered.__dict__)
    loose = types.ModuleType("unison_test_loose")
    exec("def fn():\n    return 1\n", loose.__dict__)
    monkeypatch.setitem(sys.modules, registered.__name__, registered)
    cloudpickle.register_pickle_by_value(registered)
    try:
        assert not fncache._by_reference(registered.fn) and fncache._by_reference(first)
        assert not fncache._by_reference(loose) and fncache._by_reference(functools)
        monkeypatch.setattr(fncache, "_cloudpickle_by_reference", None)
        assert not fncache._by_reference(first)  # cloudpickle cannot say: by value
    finally:
        cloudpickle.unregister_pickle_by_value(registered)
