"""Where the fast path's kernel features are missing, a session still starts (on the pipe
channel) or says clearly why it can't; it never fails obscurely.

The platform is simulated in a real controller script by removing ``os.memfd_create``
before unison is imported, as on a kernel or libc without it."""

from __future__ import annotations

from support import stop


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
    try:
        out, err = proc.communicate(timeout=60)
    except BaseException:
        stop(proc)
        raise
    assert proc.returncode == 0, err
    assert out.rstrip().endswith("done"), out
    collective = next(line for line in out.splitlines() if line.startswith("collective:"))
    assert "memfd" in collective, out
    empty = next(line for line in out.splitlines() if line.startswith("empty:"))
    assert "memfd" in empty, out
