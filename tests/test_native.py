"""The command ring's C fast path (src/unison/_ring.c, issue 9): it builds with README's
install command, it is chosen automatically, and it speaks exactly the pure-Python ring's
protocol: either side may be either, through wraps of the ring, skips of entries for other
workers, and entries with buffers (which stay on the Python path)."""

from __future__ import annotations

import importlib
import io
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import unison
from unison import _native
from unison.channel import shm

SCRIPT = r"""
import numpy as np, unison
from unison.channel import shm
with unison.Session(3, env={ENV}) as sess:
    total = 0
    for i in range(6000):  # ~40 laps of messages of varying sizes: several ring wraps
        pad = "x" * (i % 700)
        ref = sess[i % 3].call(lambda p, i=i: (len(p), i), pad)
        if i % 97 == 0:
            assert ref.get(i % 3) == (len(pad), i)
    sess.sync()
    big = sess.put(np.arange(100_000, dtype=np.int64))  # buffers: the Python path
    assert sess.run(lambda a: int(a.sum()), big) == [int(np.arange(100_000).sum())] * 3
    assert sess.run(unison.rank) == [0, 1, 2]
    sess.call(lambda: 1 / (unison.rank() - 1))  # sync reads the workers' unreported errors
    try:
        sess.sync()
    except unison.WorkerError as exc:
        assert list(exc.errors) == [1], exc
    else:
        raise AssertionError("sync lost worker 1's error")
    sess.sync()  # reported once
    print("native", shm.NATIVE, "ok")
"""


def test_the_extension_is_built_and_chosen() -> None:
    if _native.pure_asked():
        pytest.skip("UNISON_PURE is set: the pure-Python ring was asked for")
    import unison._ring  # noqa: F401  (README's install command builds it)

    assert shm.NATIVE


@pytest.mark.parametrize("value,pure", [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("", False), ("false", False), ("Off", False), ("no", False),
])
def test_unison_pure_reads_on_and_off(monkeypatch: pytest.MonkeyPatch, value: str,
                                      pure: bool) -> None:
    """UNISON_PURE=0 once picked pure Python (any non-empty value did): a run meant to
    measure the C ring measured the fallback, and nothing said so."""
    monkeypatch.setenv("UNISON_PURE", value)
    assert _native.pure_asked() is pure
    assert (_native.load("_ring") is None) is (pure or not _native.built("_ring"))


@pytest.mark.parametrize("value", ["2", "pure", "maybe"])
def test_unison_pure_of_another_value_raises_and_says_what_to_set(
        monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("UNISON_PURE", value)
    with pytest.raises(ValueError, match=f"UNISON_PURE='{value}'.*set it to 1"):
        _native.pure_asked()


def test_unison_pure_0_runs_the_c_ring_in_a_fresh_process() -> None:
    if not _native.built("_ring"):
        pytest.skip("the C ring is not built here, or is stale")
    env = {**os.environ, "UNISON_PURE": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", "from unison.channel import shm; print(shm.NATIVE)"],
        env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "True", proc.stderr


def test_the_c_ring_tells_an_ok_reply_by_the_protocols_code() -> None:
    """run's quick path (_ring.Sender.values) tells an OK reply from an error by
    protocol.OK, compiled into _ring.c: they must agree."""
    if not _native.built("_ring"):
        pytest.skip("the C ring is not built here, or is stale")
    import unison._ring
    from unison import protocol

    assert unison._ring.OK == protocol.OK
    assert unison._ring.ARRAY == protocol.ARRAY


def test_the_fence_is_one_c_call_where_built_and_a_locked_flush_otherwise() -> None:
    """The store-load fences of the channel and the cancellation board: the C one where
    _ring was built. The pure fallback is a BufferedWriter's flush, a C method that takes and
    releases the writer's lock within the call: no Python frame, and no lock a signal's
    exception could leave held (the next fence would then raise or block)."""
    from unison import cancel

    if _native.pure_asked():
        assert _native.fence.__self__.__class__ is io.BufferedWriter  # type: ignore[attr-defined]
    else:
        import unison._ring

        assert _native.fence is unison._ring.fence
    assert shm._fence is _native.fence and cancel._fence is _native.fence
    pure = _native._locked_flush()
    assert type(pure).__name__ == "builtin_function_or_method"
    for _ in range(3):
        _native.fence()
        pure()

    errors: list[BaseException] = []

    def hammer() -> None:  # threads share it: each call waits for the GIL, never the lock
        try:
            for _ in range(20000):
                pure()
        except BaseException as exc:  # a thread's error would otherwise only be printed
            errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads swap often: a lock held across bytecodes would show
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    pure()


@pytest.mark.parametrize("controller_pure,workers_pure", [
    (False, False), (True, True), (False, True), (True, False),
], ids=["native", "pure", "native-controller", "native-workers"])
def test_both_rings_speak_one_protocol(controller_pure: bool, workers_pure: bool) -> None:
    env = dict(os.environ)
    env.pop("UNISON_PURE", None)
    if controller_pure:
        env["UNISON_PURE"] = "1"
    worker_env = {r: {"UNISON_PURE": "1" if workers_pure else ""} for r in range(3)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT.replace("{ENV}", repr(worker_env))],
                          env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"native {not controller_pure} ok" in proc.stdout


def test_a_large_message_and_small_ones_interleave(sess: unison.Session) -> None:
    arr = np.random.default_rng(0).standard_normal(1 << 16)
    for i in range(50):
        big = sess.put(arr if i % 2 else arr[: i + 1])
        assert sess.run(lambda a: float(a[-1]), big) == [float((arr if i % 2 else
                                                                 arr[: i + 1])[-1])] * 2


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_a_workers_mark_on_the_board(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Board.mark(rank): the word a worker writes around every call (in C where _ring was
    built). Both kinds write the same words and see the same posts; closing the board lets
    go of its memory even while a mark is held."""
    from unison import cancel

    if native and not _native.built("_ring"):
        pytest.skip("_ring is not built here, or is stale")
    monkeypatch.setattr(cancel, "_ring", importlib.import_module("unison._ring") if native
                        else None)  # whatever UNISON_PURE says here
    board = cancel.Board(3)
    try:
        mark = board.mark(2)
        assert board.mark(2) is mark  # one per rank: the inline worker 0 asks on every call
        assert isinstance(mark, cancel._Mark) is not native
        assert mark.enter(5) is False and board.running(2) == 5 and board.running(1) == 0
        assert mark.leave() is False  # not cancelled meanwhile
        assert board.running(2) == 0
        assert board.past(5, (2,)) and not board.past(7, (2,))
        assert board.post(5, (2,)) is False  # worker 2 is past 5: nothing to post
        assert board.post(7, (2,)) is True
        with pytest.raises(RuntimeError, match="shares its slot"):  # 7 still queued on 2
            board.post(7 + cancel.TABLE, (1,))
        assert mark.enter(7) is True and not board.past(7, (2,))
        assert mark.leave() is True  # cancelled: the call ends cancelled, even had it run
        assert mark.enter(8) is False and board.post(8, (2,)) is True
        assert mark.leave() is True  # cancelled while it ran (its signal blocked, ignored)
        assert board.past(7, (2,))
        board.post(7 + cancel.TABLE, (2,))  # the same slot: 7 is behind every worker now
        assert mark.enter(7 + cancel.TABLE) is True and board.running(2) == 7 + cancel.TABLE
    finally:
        board.close()
    for use in (lambda: mark.enter(1), mark.leave):  # Python's as C's, not a memoryview's
        with pytest.raises(ValueError, match=r"^the board is closed$"):
            use()


STALE = r"""
import warnings
warnings.simplefilter("always")
import numpy as np, unison
from unison.channel import shm
from unison.collective import shm as coll
with unison.Session(2) as sess:
    assert sess.run(lambda x: x + unison.rank(), 40) == [40, 41]
    out = sess.run(lambda: unison.allreduce(np.full(8, 1.0 + unison.rank())).tolist())
    assert out == [[3.0] * 8] * 2, out
    print("native", shm.NATIVE, coll._coll is not None, "ok")
    print("from", unison.__file__.rpartition("/")[0])
import subprocess, sys  # another program this one starts says its own warnings
subprocess.run([sys.executable, "-c", "import unison.channel.shm"], check=True)
"""


@pytest.mark.parametrize("edit", [False, True], ids=["as-built", "stale"])
def test_a_module_built_from_another_source_is_refused_with_how_to_rebuild(
        tmp_path: Path, edit: bool) -> None:
    """An editable install after a ``git pull`` without a rebuild: the C file changed, the
    built module did not. The thirty-seventh pass's session then failed at start (replies()
    took another argument); a layout change could misread memory. Both extensions carry
    their file's digest (setup.py); one that differs from the file beside it is refused
    with a warning that says how to rebuild, and the session runs on pure Python. A copy of
    the package with the built modules: as built, it runs in C; with the C files edited, in
    Python, right."""
    if not (_native.built("_ring") and _native.built("_coll")):
        pytest.skip("the extensions are not built here, or are stale")
    copy_package(tmp_path)
    if edit:
        for name in ("_ring.c", "_coll.c"):
            with open(tmp_path / "unison" / name, "a") as f:
                f.write("/* a change after the build */\n")
    said = run_copy(tmp_path, STALE)
    if not edit:
        assert "native True True ok" in said, said
        assert "RuntimeWarning" not in said, said
        return
    assert "native False False ok" in said, said
    for name in ("_ring", "_coll"):
        assert re.search(rf"RuntimeWarning: unison\.{name} .* was built from another "
                         rf"{name}\.c than the one beside it .* Rebuild it: `pip install "
                         r"-e \.`", said), said
        # once a session: the workers, which load the same build, do not repeat it; the
        # other program does (before, the controller's os.environ silenced it there too)
        assert said.count(f"RuntimeWarning: unison.{name} ") == 2, said


def copy_package(to: Path) -> Path:
    """A copy of the package, built modules included, under ``to``; its directory."""
    root = Path(__file__).resolve().parent.parent / "src" / "unison"
    shutil.copytree(root, to / "unison", ignore=shutil.ignore_patterns("__pycache__"))
    return to / "unison"


def run_copy(at: Path, script: str) -> str:
    """Run ``script`` on the copy of the package at ``at`` (UNISON_PURE unset, no earlier
    warning inherited); its output, checked to come from the copy."""
    env = {**os.environ, "PYTHONPATH": str(at), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("UNISON_PURE", None)
    env.pop(_native.WARNED, None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=at,
                          capture_output=True, text=True, timeout=100)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said
    assert f"from {at / 'unison'}" in proc.stdout, said
    return said


def test_the_c_ring_is_built_for_the_layout_of_shm_py() -> None:
    """What _ring.c hard-codes of the channel's layout, exported by the module: a fresh build
    agrees with shm.py (else the check below would refuse it)."""
    if not _native.built("_ring"):
        pytest.skip("the C ring is not built here, or is stale")
    import unison._ring as ring

    assert (ring.ENTRY, ring.DESC, ring.WRAP, ring.MAX_WORKERS, ring.FLAGS) == (
        shm._ENTRY, shm._DESC, shm._WRAP, shm.MAX_WORKERS, 32)
    assert shm._MORE == 1 << ring.FLAGS  # a reply head's first flag


@pytest.mark.parametrize("edit", ["none", "layout"])
def test_a_c_ring_for_another_layout_is_refused_where_no_c_file_lies_beside_it(
        tmp_path: Path, edit: str) -> None:
    """A wheel carries no _ring.c, so the digest check cannot tell a build made for another
    layout than shm.py's: once it was trusted, C and Python then read entries of
    different sizes (forty-seventh pass). The module's constants are compared with shm.py's
    at import: a build that differs warns, naming the constant and how to rebuild, and the
    session runs on pure Python, right."""
    if not _native.built("_ring"):
        pytest.skip("the C ring is not built here, or is stale")
    pkg = copy_package(tmp_path)
    for name in ("_ring.c", "_coll.c"):
        (pkg / name).unlink()
    if edit == "layout":
        text = (pkg / "channel" / "shm.py").read_text()
        assert "\n_ENTRY = 16 " in text
        (pkg / "channel" / "shm.py").write_text(text.replace("\n_ENTRY = 16 ", "\n_ENTRY = 24 "))
    said = run_copy(tmp_path, STALE)
    if edit == "none":
        assert "native True True ok" in said and "Warning" not in said, said
        return
    assert "native False True ok" in said, said
    assert re.search(r"RuntimeWarning: unison\._ring .* was built for another layout than "
                     r"the Python side's: its ENTRY is 16, the Python side's 24\. Rebuild "
                     r"it: `pip install -e \.`", said), said
    assert said.count("RuntimeWarning") == 2, said  # the controller's, and the other program's
    assert "[worker" not in said, said  # the workers do not repeat it


@pytest.mark.parametrize("so", ["foreign", "none"])
def test_a_build_that_does_not_import_warns_and_no_build_is_silent(
        tmp_path: Path, so: str) -> None:
    """A _ring build that does not import (here another module's under its name, as a
    mis-copied or half-upgraded install leaves it) once fell back to Python without a word;
    now it warns with the import's error and how to rebuild. Only where no build lies there
    at all (it did not compile) is the fallback silent."""
    if not (_native.built("_ring") and _native.built("_coll")):
        pytest.skip("the extensions are not built here, or are stale")
    pkg = copy_package(tmp_path)
    for built in pkg.glob("_ring.*.so"):
        if so == "foreign":
            shutil.copy(next(pkg.glob("_coll.*.so")), built)
        else:
            built.unlink()
    said = run_copy(tmp_path, STALE)
    assert "native False True ok" in said, said
    if so == "none":
        assert "Warning" not in said, said
        return
    assert re.search(r"RuntimeWarning: unison\._ring does not import \(.*PyInit__ring.*\), "
                     r"although _ring\..*\.so lies in .* Rebuild it: `pip install -e \.`",
                     said), said
    assert said.count("RuntimeWarning") == 2, said  # the controller's, the other program's
    assert "[worker" not in said, said  # the workers do not repeat it


def test_built_says_whether_a_fresh_build_imports_whatever_unison_pure_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests that run the extensions in their own workers or children: UNISON_PURE=1 in
    the test's process skips none of them (it once gave "not built" as their reason)."""
    monkeypatch.setenv("UNISON_PURE", "1")
    assert _native.load("_ring") is None
    for name in ("_ring", "_coll"):
        try:
            module = importlib.import_module(f"unison.{name}")
        except ImportError:
            assert not _native.built(name)
            continue
        assert _native.built(name) is (_native._stale(module) == "")
    assert not _native.built("_nothing_of_that_name")


def test_each_built_module_records_the_digest_of_its_source() -> None:
    """The other half of the check above: a fresh build carries its file's digest, so a
    right build is never refused."""
    for name in ("_ring", "_coll"):
        try:
            module = importlib.import_module(f"unison.{name}")
        except ImportError:
            pytest.skip("the extensions are not built here")
        source = Path(module.__file__).with_name(name + ".c")
        assert (module.SOURCE, name) == (_native.source_digest(source), name)


def test_without_a_compiler_the_build_goes_on_and_builds_nothing(tmp_path: Path) -> None:
    """The issue's "pure-Python fallback selected automatically when it can't build": both
    extensions are optional, so a failing compiler (CC=false) leaves the install going on
    with no extension, and unison then picks pure Python (test_both_rings_speak_one_protocol
    runs that path)."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "CC": "false", "CXX": "false", "LDSHARED": "false"}
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "tmp")],
        cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not list(tmp_path.rglob("*.so")), list(tmp_path.rglob("*.so"))
    said = (proc.stdout + proc.stderr).splitlines()
    for name in ("unison._ring", "unison._coll"):  # each tried, failed, and skipped
        assert any(name in line and "failed" in line for line in said), said


def test_c_collective_steps_built_for_another_record_layout_warn_and_are_refused(monkeypatch):
    """_coll's layout check returned None in silence, where _ring's now warns: a run meant
    to measure the C steps measured the fallback with no word (issue 9, forty-seventh pass)."""
    from types import SimpleNamespace

    from unison.collective import shm as coll_shm

    real = importlib.import_module("unison._coll") if _native.built("_coll") else None
    fake = SimpleNamespace(__name__="unison._coll", __file__=str(Path(coll_shm.__file__)),
                           RECORD=(0,) * 7, GENERATION=getattr(real, "GENERATION", None),
                           SOURCE=getattr(real, "SOURCE", ""))
    monkeypatch.setattr(_native, "pure_asked", lambda: False)
    monkeypatch.setattr(_native, "_stale", lambda module: "")
    load = importlib.import_module
    monkeypatch.setattr(_native.importlib, "import_module",
                        lambda name: fake if name == "unison._coll" else load(name))
    monkeypatch.delenv(_native.WARNED, raising=False)
    _native._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match=r"its RECORD is \(0, 0, 0, 0, 0, 0, 0\)"):
        assert coll_shm._steps_in_c() is None
    _native._warn_once.cache_clear()
