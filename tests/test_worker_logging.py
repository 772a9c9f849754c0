"""Workers' logging records reach the controller's logging (issue 13): with ``record.rank``,
the logger's name, the message with its arguments applied, exception text, once each; the
controller's handlers and format apply, and its logger levels (at the session's start)
decide what workers ship. Real workers; the relay is asynchronous, so tests wait for the
records to arrive."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator

import pytest

import unison
from support import stop, wait_gone

pytestmark = pytest.mark.timeout(120)


class Collect(logging.Handler):
    """Keeps records, and their text as this handler's formatter writes it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(rank)s|%(name)s|%(levelname)s|%(message)s"))
        self.records: list[logging.LogRecord] = []
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.lines.append(self.format(record))

    def wait_for(self, text: str, count: int = 1, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(text in line for line in self.lines) < count:
            assert time.monotonic() < deadline, f"{text!r} never arrived: {self.lines}"
            time.sleep(0.02)


@pytest.fixture
def collect() -> Iterator[Collect]:
    """A handler on the controller's "app" logger (level INFO), removed afterwards."""
    handler = Collect()
    logger = logging.getLogger("app")
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def log_some(tag: str) -> None:
    log = logging.getLogger("app.worker")
    log.debug("debug %s from %d", tag, unison.rank())
    log.info("info %s from %d", tag, unison.rank())
    log.warning("warning %s from %d", tag, unison.rank())
    try:
        1 / 0  # noqa: B018
    except ZeroDivisionError:
        log.exception("failed %s on %d", tag, unison.rank())
    log.warning("last %s from %d", tag, unison.rank())


def test_info_and_warning_records_reach_the_controllers_handler(make_session, collect):
    sess = make_session(2)
    sess.run(log_some, "t1")
    for r in (0, 1):
        collect.wait_for(f"{r}|app.worker|WARNING|last t1 from {r}")
    lines = collect.lines
    for r in (0, 1):
        assert lines.count(f"{r}|app.worker|INFO|info t1 from {r}") == 1  # once: no doubles
        assert lines.count(f"{r}|app.worker|WARNING|warning t1 from {r}") == 1
    assert not any("debug t1" in line for line in lines)  # the controller's "app" is at INFO
    rec = next(r for r in collect.records if r.getMessage() == "info t1 from 1")
    assert rec.rank == 1  # type: ignore[attr-defined]
    assert rec.levelno == logging.INFO and rec.name == "app.worker"
    assert rec.funcName == "log_some" and rec.pathname == __file__
    assert rec.process == sess._pids[1]
    assert rec.created <= time.time()


def test_exception_text_arrives(make_session, collect):
    sess = make_session(1)
    sess.run(log_some, "t2")
    collect.wait_for("last t2 from 0")
    rec = next(r for r in collect.records if r.getMessage() == "failed t2 on 0")
    assert rec.levelno == logging.ERROR
    assert rec.exc_text is not None
    assert "Traceback (most recent call last)" in rec.exc_text
    assert "ZeroDivisionError: division by zero" in rec.exc_text
    text = next(line for line in collect.lines if "failed t2 on 0" in line)
    assert "ZeroDivisionError" in text  # the formatter appends it, as for a local record


def test_caplog_sees_worker_records(make_session, caplog):
    caplog.set_level(logging.INFO)
    sess = make_session(1)
    sess.run(lambda: logging.getLogger("other").info("hello %s", "caplog"))
    deadline = time.monotonic() + 20
    while not any(r.getMessage() == "hello caplog" for r in caplog.records):
        assert time.monotonic() < deadline, caplog.records
        time.sleep(0.02)
    rec = next(r for r in caplog.records if r.getMessage() == "hello caplog")
    assert rec.rank == 0 and rec.name == "other"  # type: ignore[attr-defined]


def test_plain_stderr_is_still_relayed_and_the_tail_keeps_records(make_session, collect, capfd):
    sess = make_session(1)

    def both() -> None:
        import sys

        print("plain line", file=sys.stderr)
        logging.getLogger("app").warning("as a record")

    sess.run(both)
    collect.wait_for("0|app|WARNING|as a record")
    deadline = time.monotonic() + 10
    err = ""
    while "plain line" not in err:
        err += capfd.readouterr().err
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert "[worker 0] plain line" in err
    assert "as a record" not in err  # handled by logging, not printed as well
    tail = "".join(sess._res.launcher.workers[0].stderr_tail)
    assert "WARNING:app:as a record" in tail and "plain line" in tail


def log_after_progress_bars() -> None:
    import sys

    for i in range(3):
        sys.stderr.write(f"\rtraining {i * 50}%|{'#' * i}")  # as tqdm draws it: no newline
        sys.stderr.flush()
        logging.getLogger("app").warning("step %d done", i)
    sys.stderr.write("\n")


def test_a_record_after_a_partial_line_is_still_a_record(make_session, collect, capfd):
    sess = make_session(1)
    sess.run(log_after_progress_bars)
    collect.wait_for("0|app|WARNING|step 2 done")
    assert [r.getMessage() for r in collect.records] == [f"step {i} done" for i in range(3)]
    deadline = time.monotonic() + 10
    err = ""
    while "training 100%" not in err:
        err += capfd.readouterr().err
        assert time.monotonic() < deadline, err
        time.sleep(0.02)
    assert "unison-log" not in err  # not printed raw
    assert "[worker 0] \rtraining 50%|#\n" in err  # the partial line: plain output
    tail = "".join(sess._res.launcher.workers[0].stderr_tail)
    assert "\rtraining 50%|#\nWARNING:app:step 1 done\n" in tail


def log_long(text: str, bar: int) -> None:
    import fcntl
    import sys

    fcntl.fcntl(2, fcntl.F_SETPIPE_SZ, 1 << 20)  # room for all of it while the relay waits,
    logging.getLogger("app").warning("hold")  # here, so that it reads 64 KiB at once
    time.sleep(0.1)
    sys.stderr.write("\r" + "=" * bar)  # a partial line first, this long
    sys.stderr.flush()
    try:
        raise ValueError("v" * 30_000 + "end")
    except ValueError:
        logging.getLogger("app").exception(text)
    logging.getLogger("app").warning("after")


@pytest.mark.parametrize(("char", "count", "bar"), [
    ("é", 12_000, 0),  # 72 KiB as \u escapes, 24 KiB as UTF-8: was lost, printed raw
    ("中", 40_000, 0),  # more than a line's worth as UTF-8 too: cut, saying so
    ("😀", 20_000, 0),
    ("a", 50_000, 30_000),  # the relay's cut (64 KiB, a full pipe) lands in the record
    ("é", 25_000, 65_530),  # or in its mark
    ("a", 50_000, 70_000),  # or in a partial line longer than the cut
])
def test_a_long_record_arrives_whole_or_cut_never_raw(make_session, collect, capfd,
                                                      monkeypatch, char, count, bar):
    def slow(record: logging.LogRecord) -> bool:
        if record.getMessage() == "hold":
            time.sleep(0.5)
        return True

    monkeypatch.setattr(collect, "filter", slow)  # (called for each record before emit)
    sess = make_session(1)
    sess.run(log_long, char * count, bar)
    collect.wait_for("0|app|WARNING|after")
    rec = next(r for r in collect.records if r.levelno == logging.ERROR)
    assert rec.levelno == logging.ERROR
    msg = rec.getMessage()
    assert msg.startswith(char * 1000)
    if len(msg) != count:
        assert msg.rstrip("]").endswith("characters cut")
        kept, note = msg.split(" [... ")
        assert kept == char * len(kept) and len(kept) > 8000
        assert int(note.split()[0]) == count - len(kept)
    assert rec.exc_text.endswith("ValueError: " + "v" * 50) or rec.exc_text.endswith("end")
    time.sleep(0.2)
    err = capfd.readouterr().err
    assert "unison-log" not in err and "{" not in err
    assert err.count("=") == bar


def test_a_record_line_never_passes_the_relays_limit():
    from unison.debug import logs

    base = {"name": "app", "levelno": 30, "created": 1.5}
    for ascii in (True, False):
        for text in ("é" * 40_000, "中" * 70_000, "😀" * 30_000, "\udcff" * 20_000,
                     '"' * 40_000, "x" * 10_000_000):
            for key in ("msg", "exc_text", "name"):
                line = logs._line({**base, key: text}, ascii)
                size = len(line.encode("utf-8", "backslashreplace"))
                assert size <= logs.LINE_BYTES and line.startswith(logs.MARK), (ascii, key)
                assert size > logs.LINE_BYTES * 0.8  # not cut far more than needed
                data = json.loads(line[len(logs.MARK):])
                assert "characters cut]" in data[key]
                note, _, kept = data[key].partition("]\n")  # a traceback keeps its end
                if not kept:
                    kept, _, note = data[key].partition(" [")
                assert kept == text[:len(kept)] and int(note.split()[1]) == len(text) - len(kept)


def log_many(n: int) -> None:
    for i in range(n):
        logging.getLogger("app").info("record %d", i)


class Gated(logging.Handler):
    """Holds the relay at the first record until ``gate`` is set (the worker's records wait
    in the pipe meanwhile), then takes ``pause`` seconds a record; counts calls after
    ``closed`` is set."""

    def __init__(self, pause: float) -> None:
        super().__init__(logging.INFO)
        self.gate = threading.Event()
        self.pause = pause
        self.closed = False
        self.handled = 0
        self.late = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.gate.wait(20)
        self.late += self.closed
        time.sleep(self.pause)
        self.handled += 1


@pytest.fixture
def gated(request) -> Iterator[Gated]:
    handler = Gated(request.param)
    logger = logging.getLogger("app")
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    handler.gate.set()
    logger.removeHandler(handler)
    logger.setLevel(old)


@pytest.mark.parametrize("gated", [0.01], indirect=True)
def test_close_hands_over_what_the_workers_logged_before_it_returns(gated):
    sess = unison.Session(1)
    try:
        sess.run(log_many, 100)  # all in the pipe: the relay is held at the first
    finally:
        gated.gate.set()  # 1 s of handling left: the relay used to be given 0.5 s
        sess.close()
    gated.closed = True
    assert gated.handled == 100
    assert not sess._res.launcher._relay.is_alive()


@pytest.mark.parametrize("gated", [0.05], indirect=True)
def test_what_close_cannot_hand_over_in_time_is_dropped_with_a_warning(gated):
    sess = unison.Session(1)
    try:
        sess.run(log_many, 100)
    finally:
        gated.gate.set()
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match=r"(\d+) logging record\(s\) .* were dropped") \
                as warned:
            sess.close(timeout=0)  # the relay gets 1 s: 20 of the 5 s it needs
    gated.closed = True
    assert time.monotonic() - start < 3.0
    assert not sess._res.launcher._relay.is_alive()  # it never calls a handler again
    dropped = int(str(warned[0].message).split("): ")[1].split()[0])
    assert 0 < dropped < 100 and gated.handled + dropped == 100
    time.sleep(0.2)
    assert gated.late == 0


def fails() -> None:
    raise ValueError("unseen")


@pytest.mark.parametrize("gated", [0.05], indirect=True)
def test_warnings_as_errors_a_close_that_drops_output_still_says_the_errors_nobody_fetched(
        gated):
    """Under -W error the warning of the dropped output came out of the workers' stop and
    cut the close short before it said the errors nobody fetched: they vanished. Now every
    warning is issued, the first raised, the others as its notes."""
    sess = unison.Session(1)
    try:
        sess.call(fails)
        sess.run(log_many, 100)
    finally:
        gated.gate.set()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RuntimeWarning, match="not all handed over") as info:
                sess.close(timeout=1.0)  # the errors are handed over; the relay needs 5 s
    gated.closed = True
    assert "fails raised ValueError: unseen" in "".join(getattr(info.value, "__notes__", []))
    assert sess.closed


@pytest.mark.parametrize("gated", [0.05], indirect=True)
def test_warnings_as_errors_ctrl_c_in_closes_drain_goes_on_with_the_warning_as_its_note(gated):
    """Under -W error, Ctrl-C while close waits for the relay: the warning of what it
    dropped was raised in place of KeyboardInterrupt. Now KeyboardInterrupt goes on, that
    warning as its note, and everything is released all the same."""
    sess = unison.Session(1)
    pids = sess.run(os.getpid)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    try:
        sess.run(log_many, 100)
    finally:
        gated.gate.set()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            timer.start()  # inside the drain, which needs 5 s
            try:
                with pytest.raises(KeyboardInterrupt) as info:
                    sess.close(timeout=0)
            finally:
                timer.cancel()
                timer.join()
                sess.close(timeout=0)
    gated.closed = True
    assert "not all handed over" in "".join(getattr(info.value, "__notes__", [])), info.value
    assert sess.closed and wait_gone(pids, 2.0) == []


@pytest.mark.parametrize("gated", [0.0], indirect=True)
def test_a_handler_that_does_not_return_does_not_hold_close(gated):
    sess = unison.Session(1)
    sess.run(log_many, 10)  # the relay waits in the handler, at the first record
    with pytest.warns(RuntimeWarning, match="still inside a handler"):
        sess.close(timeout=0)
    launcher = sess._res.launcher
    assert launcher._relay.is_alive() and not launcher.workers[0].popen.stderr.closed
    gated.gate.set()  # it returns: the relay calls no handler again, and lets go
    launcher._relay.join(5)
    assert not launcher._relay.is_alive() and launcher.workers[0].popen.stderr.closed
    assert gated.handled == 1


def test_without_logging_configured_warnings_print_with_the_rank(controller):
    """A controller script that configures no logging: as Python's last resort would, with
    the rank in front, and INFO is not shown."""
    proc = controller("""
        import logging, unison
        with unison.Session(2) as sess:
            sess.run(lambda: logging.getLogger("x").warning("careful %d", unison.rank()))
            sess.run(lambda: logging.getLogger("x").info("not shown"))
            sess.run(lambda: logging.getLogger("x").warning("done"))
            import time; time.sleep(0.5)
        print("finished")
    """)
    out, err = stop_after(proc)
    assert "finished" in out, err
    assert "[worker 0] careful 0" in err and "[worker 1] careful 1" in err
    assert "not shown" not in err
    assert "unison-log" not in err


def stop_after(proc, timeout: float = 60.0) -> tuple[str, str]:
    try:
        proc.wait(timeout)
    except Exception:
        pass
    return stop(proc)
