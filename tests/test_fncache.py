"""The session's function cache remembers the last function it found (issue 9's hot path):
never past the moment its copy on the workers may be gone or stale."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import unison
from unison.session import api
from unison.session.fncache import FunctionCache, pickle_function


def first() -> int:
    return 1


def second() -> int:
    return 2


def third() -> int:
    return 3


def test_the_last_function_found_is_remembered_only_while_its_copy_is_current() -> None:
    cache = FunctionCache(size=2)
    assert cache.store(first, 1, b"first") == []
    assert cache.last is None  # stored is not found: the send that defined it looks again
    assert cache.lookup(first) == (1, None)
    assert (cache.last, cache.last_id) == (first, 1)
    assert cache.lookup(second) == (0, None)  # a miss forgets it too
    assert cache.last is None
    assert cache.lookup(first) == (1, None)
    assert cache.store(second, 2, b"second") == []
    assert cache.last is None  # a store may drop any entry
    assert cache.lookup(first) == (1, None)  # first is the most recent again: second goes
    assert cache.store(third, 3, b"third") == [2]
    assert cache.lookup(second) == (0, None)
    assert cache.lookup(first) == (1, None)
    assert cache.store(second, 4, b"second") == [3]
    assert cache.lookup(first) == (1, None)
    assert cache.last is first


def test_a_function_sent_by_value_is_never_remembered_as_current() -> None:
    cache = FunctionCache()
    box, size = [1], 2

    def mutable() -> int:  # compared by its pickle at each lookup
        return box[0]

    def planned() -> int:  # its captures checked by identity at each lookup
        return size

    for fn_id, fn in enumerate((mutable, planned), 1):
        cache.store(fn, fn_id, pickle_function(fn))
        assert cache.lookup(fn) == (fn_id, None)
        assert cache.last is None


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
