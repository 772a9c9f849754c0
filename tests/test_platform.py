"""Where the fast path's kernel features are missing, a session still starts (on the pipe
channel) or says clearly why it can't; it never fails obscurely.

The platform is simulated in a real controller script by removing ``os.memfd_create``
before unison is imported, as on a kernel or libc without it."""

from __future__ import annotations

import pytest

from support import stop
from unison import _native, collective
from unison.errors import CollectiveError


def _output(proc) -> str:
    """What the controller script printed, once it exited with 0 (stopped if it does not)."""
    try:
        out, err = proc.communicate(timeout=60)
    except BaseException:
        stop(proc)
        raise
    assert proc.returncode == 0, err
    return out


def test_without_memfd_the_session_runs_on_the_pipe_channel(controller):
    proc = controller("""
        import os
        del os.memfd_create
        import unison

        def total(x):
            return x + unison.rank()

        def reduce():
            return unison.allreduce(1)

        with unison.Session(2) as sess:
            assert type(sess._chan).__name__ == "PipeChannel", sess._chan
            assert sess.run(total, 10) == [10, 11]
            assert sess.scatter([1, 2]).gather() == [1, 2]
            try:
                sess.run(reduce)
            except unison.WorkerError as exc:
                print("collective:", exc.__cause__)
            else:
                print("collective: ran")
            try:
                sess.empty(4)
            except Exception as exc:
                print("empty:", type(exc).__name__, exc)
            else:
                print("empty: ran")
        print("done")
    """)
    out = _output(proc)
    assert out.rstrip().endswith("done"), out
    collective = next(line for line in out.splitlines() if line.startswith("collective:"))
    assert "memfd" in collective, out
    empty = next(line for line in out.splitlines() if line.startswith("empty:"))
    assert "memfd" in empty, out


def test_on_a_cpu_without_x86s_memory_order_shared_memory_is_refused_with_the_reason(
        controller, tmp_path, monkeypatch):
    """An ARM host, simulated in the controller and in every worker (a sitecustomize that
    every interpreter imports at start): the session runs on the pipe channel, and what
    would read shared memory with Python's plain stores (an explicit channel="shm", the
    collectives, the cancellation board) says why it can't, never runs."""
    (tmp_path / "sitecustomize.py").write_text(
        "import platform\nplatform.machine = lambda: 'aarch64'\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    proc = controller("""
        import platform, time
        import numpy as np
        import unison

        def reduce():
            return unison.allreduce(np.ones(2))

        def machine():
            import platform
            return platform.machine()

        with unison.Session(2) as sess:
            print("channel:", type(sess._chan).__name__)
            print("workers:", sess.run(machine))
            try:
                sess.run(reduce)
            except unison.WorkerError as exc:
                print("collective:", type(exc.__cause__).__name__, exc.__cause__)
            else:
                print("collective: ran")
            ref = sess.call(time.sleep, 0.5)
            try:
                ref.cancel()
            except RuntimeError as exc:
                print("cancel:", exc)
            else:
                print("cancel: ran")
            assert sess.run(machine) == ["aarch64", "aarch64"]
        try:
            unison.Session(2, channel="shm")
        except ValueError as exc:
            print("shm:", exc)
        else:
            print("shm: ran")
        print("done", platform.machine())
    """)
    out = _output(proc)
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert out.rstrip().endswith("done aarch64"), out
    assert lines["channel"] == "PipeChannel", out
    assert lines["workers"] == "['aarch64', 'aarch64']", out
    for key in ("collective", "cancel", "shm"):
        assert "total store order" in lines[key] and "aarch64" in lines[key], (key, out)
    assert lines["collective"].startswith("CollectiveError"), out
    assert "collectives='torch'" in lines["collective"], out
    assert "channel='pipe'" in lines["shm"], out


def test_a_cluster_worker_on_a_cpu_without_x86s_memory_order_keeps_off_shared_memory(
        monkeypatch):
    """A worker that joined over TCP judges its own CPU (a cluster's hosts may differ from
    the controller's): where a host's workers would share a segment, it makes none and its
    collectives say why."""
    monkeypatch.setattr(_native, "ordered_memory", lambda: False)
    spec = {"backend": "cluster", "store": None, "shared": "world",
            "host": {"name": "never-made", "first": 0, "peers": 1}}
    try:
        collective.setup(spec, 0, 2, 1, [7, (0, 1)])
        assert collective._shm is None and collective._on_shm == (False, False)
        with pytest.raises(CollectiveError, match=r"total store order.*collectives='torch'"):
            collective._choose(False)
        with pytest.raises(CollectiveError, match="total store order"):
            collective._choose(True)
    finally:
        collective.teardown()
