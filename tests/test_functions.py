"""A function defined in the user's script sees the controller's state at the moment of the
call, as concurrent.futures and loky give it: the workers never run a stale copy.

Each check runs in a real controller script, since a script's ``__main__`` functions are what
travel by value."""

from __future__ import annotations

import textwrap
import warnings

import pytest

import unison
from support import stop

TOTAL = 30.0


def run_script(controller, code: str) -> str:
    proc = controller(code)
    try:
        out, err = proc.communicate(timeout=TOTAL)
    except BaseException:
        stop(proc)
        raise
    assert proc.returncode == 0, f"controller failed:\n{err}"
    return out


def test_a_rebound_global_is_seen_even_when_the_old_object_address_is_reused(controller):
    # CPython reuses a freed object's address at once for an object of the same size, so
    # a cache keyed on id() of the captured global would keep the workers' old copy
    out = run_script(controller, """
        import unison

        class Box:
            def __init__(self, v):
                self.v = v

        CONFIG = Box(1)

        def read():
            return CONFIG.v

        with unison.Session(2) as sess:
            seen = []
            for i in range(2, 40):
                seen.append(sess.run(read)[0])
                del CONFIG  # the old Box is freed first, so the new one takes its address
                CONFIG = Box(i)
            print(seen == list(range(1, 39)), seen)
    """)
    assert out.startswith("True"), out


def test_a_mutable_global_changed_in_place_is_seen(controller):
    out = run_script(controller, """
        import numpy as np
        import unison

        SETTINGS = {"scale": 1}
        TABLE = [1, 2]
        WEIGHTS = np.zeros(3)

        def read():
            return SETTINGS["scale"], sum(TABLE), float(WEIGHTS.sum())

        with unison.Session(2) as sess:
            first = sess.run(read)
            SETTINGS["scale"] = 7
            TABLE.append(10)
            WEIGHTS[:] = 2.0
            second = sess.run(read)
            print(first, second)
            assert first == [(1, 3, 0.0)] * 2, first
            assert second == [(7, 13, 6.0)] * 2, second
    """)
    assert "(7, 13, 6.0)" in out


def test_a_closure_cell_changed_in_place_or_rebound_is_seen(controller):
    run_script(controller, """
        import unison

        def make():
            state = {"n": 0}
            count = 0
            def read():
                return state["n"], count
            def bump():
                nonlocal count
                state["n"] += 1  # the same dict, changed in place
                count += 100  # a new int in the same cell
            return read, bump

        read, bump = make()
        with unison.Session(2) as sess:
            for i in range(5):
                assert sess.run(read) == [(i, 100 * i)] * 2, (i, sess.run(read))
                bump()
    """)


def test_a_nested_script_function_that_captures_state_is_seen(controller):
    run_script(controller, """
        import unison

        LIMIT = [5]

        def inner(x):
            return min(x, LIMIT[0])

        def outer(x):
            return inner(x) + 1

        with unison.Session(2) as sess:
            assert sess.run(outer, 9) == [6, 6]
            LIMIT[0] = 2
            assert sess.run(outer, 9) == [3, 3]
            def inner(x):  # rebinding a function the outer one calls
                return -x
            assert sess.run(outer, 9) == [-8, -8]
    """)


def test_an_unchanged_function_is_not_sent_again(controller):
    # both kinds of by-value function (all-immutable captures, and a mutable one unchanged)
    # keep one definition on the workers: the worker-side function object is the same one
    out = run_script(controller, """
        import unison

        SCALE = 3
        TABLE = {"a": 1}

        def plain(x, y):
            return x * SCALE + y

        def with_dict():
            return TABLE["a"]

        def fn_ids(f):
            import gc
            return sum(1 for o in gc.get_objects()
                       if type(o).__name__ == "function" and o.__name__ == f)

        with unison.Session(1) as sess:
            for _ in range(50):
                sess.run(plain, 1, 2)
                sess.run(with_dict)
            print(sess.run(fn_ids, "plain")[0], sess.run(fn_ids, "with_dict")[0])
    """)
    assert out.split() == ["1", "1"], out


def test_resending_a_large_captured_global_warns_once_and_points_at_put(controller):
    proc = controller("""
        import warnings
        import numpy as np
        import unison

        BIG = np.zeros(300_000)  # 2.4 MB, captured by the function below

        def total():
            return float(BIG.sum())

        with unison.Session(1) as sess:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for i in range(4):
                    BIG[0] = i
                    assert sess.run(total) == [float(i)]
            texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            print(len(texts))
            print(texts[0] if texts else "")
    """)
    out, err = proc.communicate(timeout=TOTAL)
    assert proc.returncode == 0, err
    count, text = out.split("\n", 1)
    assert count == "1", out
    assert "sess.put" in text and "MiB" in text


class Handover:
    """Hands its messages over as it pickles (a drained buffer, a one-shot token): pickled
    twice, the second state, emptied, is what would arrive."""

    def __init__(self, msgs, inner=None):
        self.msgs, self.inner, self.pickled = list(msgs), inner, 0

    def __getstate__(self):
        self.pickled += 1
        msgs, self.msgs = self.msgs, []
        return {"msgs": msgs, "inner": self.inner, "pickled": self.pickled}


def test_a_script_class_is_pickled_once_each_way(controller):
    """Its ``__getstate__`` ran in plain pickle, then again in cloudpickle, whose (emptied)
    state arrived: a result (plain pickle fails on the class on a worker) and an argument
    (it names ``__main__`` on the controller)."""
    out = run_script(controller, """
        import unison

        class Outbox:
            def __init__(self, msgs):
                self.msgs, self.pickled = list(msgs), 0

            def __getstate__(self):
                self.pickled += 1
                msgs, self.msgs = self.msgs, []
                return {"msgs": msgs, "pickled": self.pickled}

        def make():
            return Outbox(["a", "b", "c"])

        def read(box):
            return box.msgs, box.pickled

        with unison.Session(1) as sess:
            got = sess.run(make)[0]
            print(got.msgs, got.pickled, sess.run(read, Outbox(["x", "y"]))[0])
    """)
    assert out.strip() == "['a', 'b', 'c'] 1 (['x', 'y'], 1)", out


def test_an_importable_value_holding_a_script_object_is_pickled_once_each_way(sess):
    """An importable class's reducer ran before plain pickle met the by-value object in its
    state, then again in cloudpickle's pass."""

    class Local:  # by value, as a script's class
        pass

    def make():
        return Handover(["a", "b"], Local())

    def read(box):
        return box.msgs, box.pickled, type(box.inner).__name__

    assert [(box.msgs, box.pickled) for box in sess.run(make)] == [(["a", "b"], 1)] * 2
    assert sess.run(read, Handover(["x"], Local())) == [(["x"], 1, "Local")] * 2


def module_level(x, y):
    return x + y


def test_module_functions_and_lambdas_still_work_in_process(sess):
    assert sess.run(module_level, 1, 2) == [3, 3]
    k = 5
    assert sess.run(lambda: k) == [5, 5]
    k = 6
    assert sess.run(lambda: k) == [6, 6]


def test_a_function_that_cannot_be_pickled_is_refused_clearly(sess):
    import threading

    lock = threading.Lock()

    def holds_a_lock():
        return lock.locked()

    with pytest.raises(TypeError, match="cannot be pickled"):
        sess.call(holds_a_lock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sess.run(unison.rank) == [0, 1]


def test_a_script_function_loads_on_the_workers_without_the_session_layer(controller):
    """Unpickling a function of the script imports the module of each reconstructor it names;
    one in unison.session (asyncio and the rest) cost each worker 75 ms at the session's
    first function of a script (issue 9, ninth pass)."""
    out = run_script(controller, """
        import sys
        import unison

        SCALE = 3

        def script_fn(x, y):
            return x * SCALE + y

        def modules():
            return sorted(m for m in sys.modules if m.startswith("unison.session"))

        with unison.Session(2) as sess:
            print(sess.run(script_fn, 7, 0.5), sess.run(modules))
    """)
    assert out.startswith("[21.5, 21.5] [[], []]"), out


def test_a_method_or_attribute_deleted_from_a_script_class_is_gone_on_the_workers(sess):
    """cloudpickle on a worker reuses the class it built from the first pickle (the same
    class tracker id) and only sets what a later pickle's state holds: a deleted method or
    attribute stayed there, and the workers ran it."""

    class Base:
        mode = "base"

        def speak(self):
            return "base speaks"

    class Child(Base):
        mode = "child"
        extra = 1

        def speak(self):
            return "child speaks"

        @classmethod
        def make(cls):
            return cls()

    def probe():
        return Child.mode, Child().speak(), hasattr(Child, "extra"), hasattr(Child, "make")

    assert sess.run(probe) == [probe()] * 2 == [("child", "child speaks", True, True)] * 2
    del Child.mode, Child.speak, Child.extra, Child.make
    assert sess.run(probe) == [probe()] * 2 == [("base", "base speaks", False, False)] * 2


def _bump_class(obj):
    type(obj).scale = 1000


def test_fetching_a_workers_object_leaves_the_controllers_class_as_it_is(sess):
    """Unpickling a worker's object of a script class set the state its pickle carried on
    the controller's own class (cloudpickle's tracker id maps to the original): a method
    or attribute changed since the workers got the class came back old, and a change a
    worker made to its copy landed in the controller's class."""

    class Acc:
        scale = 1

        def add(self, x):
            return x * self.scale

    ref = sess.put(Acc())
    Acc.scale = 10
    Acc.add = lambda self, x: -1
    ref.get()
    assert (Acc.scale, Acc().add(3)) == (10, -1)
    ref = sess.put(Acc())
    sess.run(_bump_class, ref)
    ref.get()
    assert Acc.scale == 10


def test_a_script_class_called_after_a_method_was_deleted_has_it_no_more(sess):
    class Base:
        def describe(self):
            return "base"

    class Model(Base):
        scale = 1

        def __init__(self):
            self.v = self.scale * 10

        def describe(self):
            return "model"

    def show(m):
        return m.v, m.describe()

    assert sess.run(show, sess.call(Model)) == [(10, "model")] * 2
    Model.scale = 2
    del Model.describe
    assert sess.run(show, sess.call(Model)) == [(20, "base")] * 2
    assert sess.run(show, Model()) == [(20, "base")] * 2  # (the class inside an argument)
    back = sess.run(Model)  # a worker's instance comes back: to the controller's own class
    assert type(back[0]) is Model and back[0].v == 20


SESSION_AT_IMPORT = """
    import os, unison
    depth = int(os.environ.get("UNISON_TEST_IMPORT_DEPTH", "0"))
    os.environ["UNISON_TEST_IMPORT_DEPTH"] = str(depth + 1)

    class Box:
        pass

    def where():
        return depth

    if depth < 2:  # the test's brake: before, each worker's import opened a session too
        with unison.Session(1) as sess:
            sess.run({call})
"""


@pytest.mark.parametrize("call", ["where", "repr, Box()"])
def test_a_module_that_opens_a_session_when_imported_is_refused_in_the_workers(
        controller, tmp_path, call):
    # multiprocessing refuses its analogue (a child starting a process while it imports
    # the main module); before, each worker loading the function (or an argument's class)
    # imported the module, which opened its own session, whose workers did the same
    (tmp_path / "opens_at_import.py").write_text(
        textwrap.dedent(SESSION_AT_IMPORT).format(call=call))
    out = run_script(controller, f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import unison
        try:
            import opens_at_import
        except unison.WorkerError as exc:
            print("refused:", exc.__cause__)

        def nested():  # a session opened by a call's body, not by an import: still fine
            with unison.Session(1) as inner:
                return inner.run(unison.rank)

        with unison.Session(1) as sess:
            print("nested:", sess.run(nested))
    """)
    assert "refused: " in out and 'Guard the session with if __name__ == "__main__"' in out
    assert "nested: [[0]]" in out
