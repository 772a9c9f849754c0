"""The worker: a loop that runs what the controller sends, keeping results in a register file.

    stdin (init, then lifeline) --> main(): keeper --> run(spec): sys.path, affinity, identity
    channel.recv() --> message --> frees dropped first
                                   CALL   regs[ref] = fn(*args)    failure -> Failed + unreported
                                          (run: reply the result or error at once, keep nothing)
                                   DEFINE fns[id] = loads(pickle)
                                   PUT    regs[ref] = value
                                   GET    reply value (or its error, which then counts as reported)
                                   SYNC   reply unreported errors, then forget them
                                   SHUTDOWN -> return

Each worker is two processes. The one the launcher starts reads its init, forks, and stays
behind as the worker's *keeper*: a few lines of Python that never run user code, so they
never wait for a GIL that a long C call holds. The keeper

  * holds the lifeline (stdin): at EOF, or when its parent changes, the controller is gone,
    and it kills the worker and all the worker started, then exits with EXIT_CONTROLLER_GONE;
  * is a child subreaper, so whatever the worker starts, even with ``start_new_session=True``
    or by double-forking, stays below it, and when the worker ends for any reason it kills
    what is left and exits with the worker's own status (the controller reads that).

The worker dies with its keeper (PR_SET_PDEATHSIG: the keeper is single-threaded, so the
signal is tied to its life, not to a thread's). Ctrl-C is ignored in both (the controller
handles it and stops us), so a terminal never shows one traceback per worker. The worker
has a process group to itself (numbered by the keeper's pid); the keeper joins its parent's,
so signals sent to the worker's group never stop or kill the keeper.

Inside a function a worker runs, ``unison.rank()`` and friends say who this worker is.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import gc
import io
import os
import pickle
import resource
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from unison import _proctree, collective, placement, protocol
from unison import trace as _trace
from unison._fdwait import FdSet
from unison.cancel import SIGNAL, Board, Cancelled
from unison.channel import WorkerChannel, connect
from unison.collective.base import Collectives
from unison.debug import logs as _debug_logs
from unison.debug import stacks as _debug_stacks
from unison.errors import EXIT_CONTROLLER_GONE, add_note
from unison.protocol import (
    ARRAY,
    CALL,
    DEFINE,
    ERR,
    GET,
    OK,
    PICKLED,
    PLAIN,
    PUT,
    SHUTDOWN,
    SYNC,
    array_value,
    dumps_plain,
    loads_plain,
    read_define,
    read_get,
    read_put,
    read_request,
)
from unison.spec import WorkerSpec

__all__ = ["group", "group_rank", "group_size", "object_count", "rank", "world_size"]

_identity: dict[str, int] = {}


def _get(key: str) -> int:
    try:
        return _identity[key]
    except KeyError:
        raise RuntimeError(
            f"unison.{key}() only works inside a function that a unison worker runs "
            "(pass the function to sess.call or sess.run)"
        ) from None


def rank() -> int:
    """This worker's global rank, 0 .. world_size() - 1."""
    return _get("rank")


def world_size() -> int:
    """The number of workers in the session."""
    return _get("world_size")


def group() -> int:
    """This worker's group, 0 .. num_groups - 1 (groups are consecutive runs of ranks)."""
    return _get("group")


def group_rank() -> int:
    """This worker's rank inside its group."""
    return _get("group_rank")


def group_size() -> int:
    """The number of workers in each group."""
    return _get("group_size")


def object_count() -> int:
    """How many objects this worker's register file holds (to check that frees arrive)."""
    return len(registers)


# -- the register file ------------------------------------------------------------------------

registers: dict[int, Any] = {}
"""This worker's objects, by the id of the call (or put) that made them."""


class Failed:
    """What a register holds when the call that should have filled it raised."""

    __slots__ = ("error",)

    def __init__(self, error: tuple[Any, ...]) -> None:
        self.error = error


class _Unloaded:
    """What a function id stands for when its function could not be loaded here: calling it
    raises why, as that call's error (so the loop needs no test of its own per call)."""

    __slots__ = ("error",)

    def __init__(self, error: tuple[Any, ...]) -> None:
        self.error = error

    def __repr__(self) -> str:  # what the error says it ran
        return "a function this worker could not load"

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Why, with the advice to make a module importable only where the load failed on
        an import or a name; and where it failed (the load's traceback). Before (an audit,
        issue 9, forty-ninth pass), a script's function whose captured object would not
        unpickle here (a ``__setstate__`` that raised) got that advice, and lost the
        original's type and frames."""
        type_name, why, tb = str(self.error[1]), str(self.error[2]), str(self.error[3])
        text = f"the function could not be loaded on this worker: {why}"
        if why.startswith(_SESSION_AT_IMPORT):  # importable: the import opened a session
            raise RuntimeError(text)
        if type_name in _NOT_FOUND:
            raise RuntimeError(
                f"{text}. Make its module importable here (workers get the controller's "
                "sys.path and cwd), or define it in the script that drives the session")
        where = f"\nWhere loading the function failed:\n{tb.rstrip()}"
        text += f" ({type_name} while unpickling it here; the load's traceback is below)"
        err = RuntimeError(text)
        add_note(err, where)  # in the remote traceback, out of the error's first line
        raise err


_NOT_FOUND = ("ModuleNotFoundError", "ImportError", "AttributeError")
"""The errors of a load that found no module or no name: the function's module is not
importable here as on the controller."""


def lookup(ref_id: int) -> Any:
    """A Ref argument, as it unpickles on a worker: that worker's own object."""
    try:
        obj = registers[ref_id]
    except KeyError:
        raise LookupError(f"Ref #{ref_id} is not held by this worker (freed already?)") from None
    if isinstance(obj, Failed):
        raise ValueError(
            f"argument Ref #{ref_id} holds no value on this worker: the call that made it "
            f"raised {obj.error[1]}: {obj.error[2]}"
        )
    return obj


# -- the loop ----------------------------------------------------------------------------------


_current: list[Any] = [0, None]
"""The call running now (0: none) and its ranks (None: every worker), for the cancellation
signal's handler and for the collectives (a call's first one tells the backends of it)."""
_board: Board | None = None


_told = [0]  # the call that learned it was cancelled (Cancelled raised, cancelled() True)
_forked = [False]  # set in a child that a worker's function forks (os.register_at_fork)
_inline = [False]  # serving as worker 0 inside the controller: a KeyboardInterrupt is Ctrl-C
_SESSION_AT_IMPORT = "a Session was opened"
_loading = [0]
"""The thread that is unpickling a function, arguments or a put value now (0: none): a
module those import that opens a Session at import would make each worker open its own,
whose workers import it again, without end (Session refuses; see ``check_not_loading``)."""


def check_not_loading() -> None:
    """Refuse a Session opened while this thread unpickles what the controller sent."""
    if _loading[0] == threading.get_ident():
        raise RuntimeError(
            f"{_SESSION_AT_IMPORT} while a worker was importing the module of a function or "
            "value sent to it: that module opens a session when imported, so each worker "
            "would open its own, whose workers import it again, without end. Guard the "
            "session with if __name__ == \"__main__\": or move it into a function")


def _end_fork() -> NoReturn:
    """A process the user's function forked returned (or raised, or sys.exit) into the
    worker's loop. The channel, the registers, the board and the collectives are its
    parent's: a word on any of them would break the session (a second reply, a worker
    killed for a reply ring that breaks the format). It ends as its function ended."""
    exc = sys.exc_info()[1]
    code = 0 if exc is None else 1
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _forked.__setitem__(0, True))


def cancelled() -> bool:
    """Inside a worker's function: whether the controller cancelled this call. Poll it in a
    long loop, to stop cleanly where ``unison.Cancelled`` would otherwise be raised."""
    call = _current[0]
    if call and _board is not None and _board.is_cancelled(call):
        _told[0] = call  # it may return early now: its value stands
        return True
    return False


def _asked(board: Board | None, call: int) -> bool:
    """Whether the controller cancelled ``call`` (``board``: serve's, worker 0 inline's
    too): a Cancelled the function raised of itself is an error like any other. Before (an
    audit, issue 9, forty-ninth pass), it was taken for a ``ref.cancel()``: ``run`` said
    so, and after ``call`` it was never reported."""
    return board is not None and board.is_cancelled(call)


def _on_cancel_signal(signum: int, frame: object) -> None:
    """The controller cancelled a running call: raise Cancelled in it, at the next bytecode.
    Only while a function runs (``_current``), so the loop's own code is never hit; and
    once a call (the controller signals again every 0.1 s while it runs: a signal may be
    lost in C code), so one that caught Cancelled may tidy up and return its value."""
    call = _current[0]
    if call and call != _told[0] and _board is not None and _board.is_cancelled(call):
        _told[0] = call  # what it returns after catching this stands
        raise Cancelled(f"call #{call} was cancelled by the controller while it ran")


class Loop:
    """What the loop keeps from one message to the next, besides the registers: the
    functions it loaded, and the errors nobody fetched yet."""

    def __init__(self) -> None:
        self.fns: dict[int, Any] = {}
        self.unreported: dict[int, tuple[Any, ...]] = {}


def serve(chan: WorkerChannel, coll: Collectives | None = None,
          board: Board | None = None, loop: Loop | None = None,
          recv: Callable[[], tuple[Any, list[Any]] | None] | None = None,
          interrupts: bool = False) -> None:
    """Run messages until SHUTDOWN, or until ``recv`` (``chan.recv``) gives None: the
    controller is gone (or, for worker 0 inline in the controller, nothing more is there
    now; its ``loop`` then carries on at the next call). ``coll`` learns where each call
    ends (``_current`` says which one runs), so that collectives can tell a peer that left
    the call from a slow one; ``board`` says
    which calls are cancelled (unison.cancel). ``interrupts``: a KeyboardInterrupt in a
    call is recorded as its error and raised on (worker 0 inline: Ctrl-C is the
    controller's, which closes the session)."""
    regs = registers
    _inline[0] = interrupts
    me = _identity.get("rank", 0)
    _forked[0] = False  # this process serves: only a fork from here on is a stranger
    _told[0] = 0  # (call ids start again in each session: inline worker 0's)
    loop = loop or Loop()
    fns, unreported = loop.fns, loop.unreported
    loads, dumps = protocol.loads, protocol.dumps
    recv = recv or chan.recv
    reply_plain = chan.reply_plain
    mark = None if board is None else board.mark(me)
    # bound once: each call's steps (collectives, the board) without an attribute lookup
    begin, end, held = (None, None, ()) if coll is None else (coll.begin, coll.end, coll.held)
    enter, leave = (None, None) if mark is None else (mark.enter, mark.leave)
    args: Any  # a call's arguments, let go after it (see the call's finally)
    kwargs: Any
    unpickling = False  # set where a call's pickled arguments failed to load (its error's label)
    while True:
        got = recv()
        if got is None:
            return
        data = got[0]  # a command is bytes or a view: protocol.loads without its frame
        msg = _loads(data) if data[0] == PICKLED else loads_plain(data)  # a CALL: marshal
        bufs = got[1]  # the out-of-band buffers of the arguments' or the value's pickle
        op, frees = msg[0], msg[1]
        if frees:
            for i in frees:
                if regs.pop(i, None) is None:
                    fns.pop(i, None)
        if op == CALL:
            _, _, ref_id, fn_id, blob, ranks, req_id = msg  # as protocol.call_msg packs it
            fn = fns.get(fn_id)
            if held:  # most calls tell the collectives nothing until their first collective
                begin(ref_id, ranks)  # type: ignore[misc]  # held: there is a backend
            traced = _trace.events  # None unless a trace runs (unison.trace)
            if traced is not None:
                started = _trace._clock()
            try:
                try:
                    # before enter() says we run it: the controller signals a call it sees
                    # running once, and a signal that found no current call would be lost
                    _current[1] = ranks  # a collective's (collective._begin)
                    _current[0] = ref_id
                    if enter is not None and enter(ref_id):
                        raise Cancelled(f"call #{ref_id} was cancelled before it started")
                    if blob is None:
                        value = fn()  # type: ignore[misc]
                    elif type(blob) is tuple:  # plain positional values, inside the message
                        value = fn(*blob)  # type: ignore[misc]
                    elif type(blob) is list:  # ... and Refs: their ids at these positions
                        args = list(blob[1])
                        for i in blob[0]:
                            args[i] = lookup(args[i])
                        if len(blob) == 2:
                            value = fn(*args)  # type: ignore[misc]
                        else:  # keyword arguments, and the names of Refs among them
                            kwargs = blob[2]  # a fresh dict, as marshal makes each
                            for k in blob[3]:
                                kwargs[k] = lookup(kwargs[k])
                            if len(blob) > 4:  # small numpy values: where, by position or name
                                for k in blob[4]:
                                    if type(k) is int:
                                        args[k] = array_value(args[k])
                                    else:
                                        kwargs[k] = array_value(kwargs[k])
                            value = fn(*args, **kwargs)  # type: ignore[misc]
                    elif type(blob) is dict:  # plain keyword values alone
                        value = fn(**blob)  # type: ignore[misc]
                    else:
                        _loading[0] = threading.get_ident()
                        try:
                            args, kwargs = loads(blob, bufs)
                        except BaseException:
                            unpickling = True
                            raise
                        finally:
                            _loading[0] = 0
                        value = fn(*args, **kwargs)  # type: ignore[misc]
                finally:
                    if _forked[0]:  # a child the call forked came back here: not ours
                        _end_fork()
                    args = kwargs = None  # (held until the next such call: the mapping of
                    # a freed value's block, or of a dropped sess.empty array, with them)
                    _current[0] = 0  # a signal in here still lands in the except below
                    # cancelled while it ran, and never told (its signal blocked or ignored)
                    late = leave is not None and leave() and _told[0] != ref_id
                    if traced is not None:  # returned or raised (its name is read at collect)
                        traced.append(("call", ref_id, req_id, fn, started, _trace._clock()))
                if late:  # it returned all the same: its signal was blocked or ignored
                    raise Cancelled(f"call #{ref_id} was cancelled by the controller while it ran")
            except BaseException as exc:  # SystemExit and friends from user code are errors too
                try:  # (it cannot fail but by a Ctrl-C, worker 0 inline, as below)
                    where = f"{_name(fn)}'s arguments" if unpickling else _name(fn)
                    unpickling = False
                    err = protocol.pack_error(exc, where, interrupts)
                    asked = isinstance(exc, Cancelled) and _asked(board, ref_id)
                    if isinstance(exc, Cancelled) and not asked:
                        err = protocol.unasked(err)
                finally:
                    if end is not None:
                        end(ref_id)
                if interrupts and isinstance(exc, KeyboardInterrupt):
                    raise
                if req_id:  # run: the error goes straight back
                    chan.reply(dumps((req_id, ERR, err)))
                else:
                    regs[ref_id] = Failed(err)
                    if not asked:  # a cancel asked for: nothing to report
                        unreported[ref_id] = err
                        chan.unreported(len(unreported))
                continue
            if end is not None:
                end(ref_id)
            if req_id:  # run: the result goes straight back, nothing is kept
                # _reply_value's plain case, inlined: a frame less on run's hot path
                if type(value) in _SCALARS or (type(value) in _OTHERS and _plain(value)):
                    out = (req_id, OK, value)
                    if not reply_plain(out, PLAIN):
                        chan.reply(dumps_plain(out, PLAIN))
                else:
                    _reply_value(chan, req_id, value, fn)
            else:
                regs[ref_id] = value
            value = None
        elif op == GET:
            req_id, ref_id = read_get(msg)
            obj = regs.get(ref_id, _MISSING)
            if isinstance(obj, Failed):
                if unreported.pop(ref_id, None) is not None:
                    chan.unreported(len(unreported))
                chan.reply(dumps((req_id, ERR, obj.error)))
            elif obj is _MISSING:
                err = protocol.pack_error(LookupError(f"Ref #{ref_id} is not held here"), "get")
                chan.reply(dumps((req_id, ERR, err)))
            else:
                _reply_value(chan, req_id, obj, ref_id=ref_id)
            obj = None
        elif op in (SYNC, SHUTDOWN):
            # SHUTDOWN too: the controller warns about errors nobody fetched
            if unreported:
                errs = list(unreported.items())
                unreported.clear()
                chan.unreported(0)  # first: the pipe's and TCP's reply says it (holding)
                chan.reply(dumps((read_request(msg), OK, errs)))
            else:
                chan.ack()
            if op == SHUTDOWN:
                return
        elif op == DEFINE:
            fn_id, fn_pickle = read_define(msg)
            _loading[0] = threading.get_ident()
            try:
                fns[fn_id] = loads(fn_pickle)
            except BaseException as exc:
                if interrupts and isinstance(exc, KeyboardInterrupt):
                    raise  # worker 0 inline: the controller's Ctrl-C, never the function's
                fns[fn_id] = _Unloaded(protocol.pack_error(exc, "loading a function",
                                                              interrupts))
            finally:
                _loading[0] = 0
        elif op == PUT:
            ref_id, value = read_put(msg)
            if isinstance(value, tuple):  # a plain value, marshalled inside the message
                regs[ref_id] = value[0]
                continue
            if isinstance(value, dict):  # every worker's plain value: ours by our rank
                regs[ref_id] = value[me]
                continue
            _loading[0] = threading.get_ident()
            try:  # its pickle, or a small numpy value as array_payload made it
                regs[ref_id] = (array_value(value[0]) if isinstance(value, list)
                                else loads(value, bufs))
            except BaseException as exc:
                if interrupts and isinstance(exc, KeyboardInterrupt):
                    raise  # (as in DEFINE)
                err = protocol.pack_error(exc, "loading a put value", interrupts)
                regs[ref_id] = Failed(err)
                unreported[ref_id] = err
                chan.unreported(len(unreported))
            finally:
                _loading[0] = 0


_MISSING = object()
_SCALARS, _plain = protocol.SCALARS, protocol.is_plain
_OTHERS = protocol.CONTAINERS | {bytes}
"""Bound here: run's hot path tests a scalar's type before it calls ``_plain``."""


_loads = pickle.loads


def _reply_value(chan: WorkerChannel, req_id: int, obj: object, fn: object = None,
                 ref_id: int = 0) -> None:
    """Reply with a value: a plain one (protocol.is_plain) by marshal, which the controller
    reads in one step (Router.quick); any other pickled, its large buffers out of band where the
    channel takes them (one copy into shared memory). A value that cannot be pickled, even
    by a BaseException from its ``__reduce__`` (KeyboardInterrupt, SystemExit), or that
    does not fit in shared memory, becomes an error for the controller instead of a dead
    worker, naming run's ``fn`` or the GET's ``ref_id``."""
    out: Any = None
    if type(obj) in _SCALARS or (type(obj) in _OTHERS and _plain(obj)):
        out = (req_id, OK, obj)  # plain: marshal takes it
    elif (array := protocol.array_payload(obj)) is not None:
        out = (req_id, ARRAY, array)  # a small numpy array or scalar: marshalled too
    if out is not None:
        if not chan.reply_plain(out, PLAIN):
            chan.reply(dumps_plain(out, PLAIN))
        return
    sent = obj  # (obj itself names its type in the errors below)
    bufs: list[pickle.PickleBuffer] | None = None
    if chan.oob_replies:
        sent, bufs = protocol.bytes_apart(obj), []
    try:
        data = protocol.dumps((req_id, OK, sent), bufs)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt) and _inline[0]:
            raise  # worker 0 inline: the controller's Ctrl-C (serve's ``interrupts``)
        problem = ("cannot be pickled back to the controller: "
                   f"{type(exc).__name__}: {protocol.safe_str(exc, _inline[0])}")
    else:
        try:
            chan.reply(data, bufs or ())
            return
        except MemoryError as exc:
            problem = f"does not fit in the shared memory for replies: {exc}"
    if fn is None:
        what, advice = (f"the value of Ref #{ref_id}", "Keep it on the worker and pass the "
                        "Ref to the calls that use it, or fetch what you need of it "
                        "(sess.run(f, ref))")
    else:
        what, advice = (f"the result of {_name(fn)}", "Keep it on the worker (sess.call "
                        "gives a Ref to pass to later calls), or return a picklable value "
                        "that fits")
    err = TypeError(f"{what} ({type(obj).__qualname__}) {problem}. {advice}.")
    where = "get" if fn is None else _name(fn)
    chan.reply(protocol.dumps((req_id, ERR, protocol.pack_error(err, where, _inline[0]))))


def _name(fn: object) -> str:
    """The called function's name, for its error report: never raises (a callable object
    whose ``repr()`` fails must not turn its call's error into a dead worker)."""
    try:
        name = getattr(fn, "__qualname__", None)
        if isinstance(name, str) and name:
            return str.__str__(name)  # exact: a subclass of the script's would not pickle
    except BaseException as exc:
        if _inline[0] and isinstance(exc, KeyboardInterrupt):
            raise  # worker 0 inline: the controller's Ctrl-C
    return protocol.safe_repr(fn, _inline[0])


# -- process set-up ----------------------------------------------------------------------------


def _read_init(parent: int) -> WorkerSpec:
    """The spec on stdin. Until it comes, a look each second that ``parent`` is still ours:
    a child the controller forked holds our stdin too, so a controller that is gone may
    never close it."""
    waiting = select.poll()
    waiting.register(0, select.POLLIN)

    def read_exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            while not waiting.poll(1000):
                if os.getppid() != parent:
                    os._exit(EXIT_CONTROLLER_GONE)
            chunk = os.read(0, n - len(buf))
            if not chunk:
                os._exit(EXIT_CONTROLLER_GONE)  # the controller went away before we started
            buf += chunk
        return buf

    size = int.from_bytes(read_exact(8), "little")
    init = pickle.loads(read_exact(size))
    if not isinstance(init, WorkerSpec):
        raise TypeError(f"a worker needs a WorkerSpec to start, got {type(init).__name__}")
    return init


_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _plain_signals() -> None:
    """Undo the signal state a worker inherits through fork and exec from whoever started
    it: a SIGCHLD of SIG_IGN (the kernel would reap the keeper's worker unseen, and the
    user's subprocesses), and a blocked mask (a session opened from a thread that blocks
    signals: Ref.cancel's signal and sess.stacks' would never arrive). The keeper's and
    the worker's own handlers are set later, on this plain ground."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def _prctl(option: int, value: int) -> bool:
    """Linux's prctl(2); False where it is missing or refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _watch_lifeline(worker: int, controller: int, rank: int) -> NoReturn:
    """The keeper's loop (see the module's docstring): it wakes on the lifeline, on SIGCHLD,
    and once a second to check that its parent is still ``controller`` (the process that
    started it: the controller, or unison.launch.zygote)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waits = FdSet([0, wake_r])
    while True:
        status = _reap(worker)
        if status is not None:
            _kill_below()  # what the worker left behind: nothing outlives it
            _exit_like(status)
        try:
            ready = waits.readable(1.0)
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        if 0 in ready:
            try:
                gone = not os.read(0, 4096)
            except OSError:
                gone = True
            if gone:
                why = "its controller went away (the lifeline closed)"
                break
        if os.getppid() != controller:
            why = f"the process that started it ({controller}) went away"
            break
    try:
        os.write(2, f"unison worker {rank}: {why}; stopping it and everything it "
                    "started\n".encode())
    except OSError:
        pass  # nobody is left to read it
    _kill_below()
    os._exit(EXIT_CONTROLLER_GONE)


def _reap(worker: int) -> int | None:
    """Reap every child that has ended (orphans adopted as subreaper too); the worker's
    wait status once it has ended, else None."""
    status = None
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == worker:
            status = st


def _kill_below() -> None:
    """Kill everything below the keeper. Killed parents hand their children to us (we are
    their subreaper), so look again until nothing is left, for a bounded time."""
    deadline = time.monotonic() + 2.0
    while _proctree.kill_tree(os.getpid(), include_root=False) and time.monotonic() < deadline:
        _reap(-1)
        time.sleep(0.002)
    _reap(-1)


def _exit_like(status: int) -> NoReturn:
    """End the keeper with the worker's own wait status, so the controller reads it."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of the keeper
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), sig)
        time.sleep(1.0)  # the signal is delivered at once; this is only a guard
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


_KEEPER_IGNORES = tuple(getattr(signal, name) for name in (
    "SIGHUP", "SIGQUIT", "SIGTSTP", "SIGTTIN", "SIGTTOU") if hasattr(signal, name))
"""A terminal's signals, besides SIGINT (ignored from the start): sent to a group the keeper
is in, never meant for it (its lifeline tells it when the controller goes)."""


def _leave_group(controller: int) -> None:
    """Move the keeper out of the process group it leads into its parent's (the zygote's, or
    the controller's for a lone worker), leaving the worker alone in the group, which keeps
    the keeper's number. A signal aimed at the worker's group (``kill -STOP -PGID``, or
    the worker's own ``killpg(getpgrp(), SIGTSTP)``) then misses the keeper, which goes on
    reporting the worker's death; before, it stopped both, and the death was never seen.
    The launcher's and the zygote's ``killpg`` of the keeper's number still reach all the
    worker left there, and the keeper is killed by its pid."""
    for sig in _KEEPER_IGNORES:
        signal.signal(sig, signal.SIG_IGN)
    try:
        os.setpgid(0, os.getpgid(controller))
    except OSError:  # the parent is gone (the lifeline says so next) or in another session
        pass


def _become_keeper(worker: int, controller: int, rank: int) -> NoReturn:
    """The parent side of the fork: leave the worker's process group, and drop everything
    but the lifeline and stderr."""
    _leave_group(controller)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # the relay sees EOF once the worker and its children are done
    os.close(devnull)
    os.closerange(3, 65536)  # channel and collective memory: the worker's, not ours
    _watch_lifeline(worker, controller, rank)


def _no_interrupt(signum: int, frame: object) -> None:
    """A worker's SIGINT: nothing. Not SIG_IGN, which the programs its code starts would
    inherit through exec (one then could not be stopped by a SIGINT, and a Python one got
    no KeyboardInterrupt; an audit, issue 9, forty-ninth pass), where a handler is reset to
    the default there. Ignored all the same: a KeyboardInterrupt in a worker process is
    its user code's own, an error (protocol.pack_error), never a signal landing in the loop."""


def main(controller: int | None = None) -> None:
    """Entry point of a local worker process (LocalLauncher's bootstrap, never a user): read
    the spec from stdin, fork into keeper and worker, then run(spec) in the worker.

    ``controller`` is the pid of the process that started us (the controller, or the
    zygote that forked us: unison.launch.zygote): if our parent is another one by the time
    we look, it is gone already."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _plain_signals()
    if controller is None:
        controller = os.getppid()
    init = _read_init(controller)
    if os.getppid() != controller:
        os._exit(EXIT_CONTROLLER_GONE)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    keeper = os.getpid()
    child = os.fork()
    if child:
        _become_keeper(child, controller, init.rank)
    # the worker: it dies with its keeper, and leaves the lifeline to it
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGINT, _no_interrupt)
    if os.getppid() != keeper:
        os._exit(EXIT_CONTROLLER_GONE)  # the keeper died before the line above
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # user code that reads stdin gets EOF, not the lifeline
    os.close(devnull)
    run(init)
    _end()


def _end() -> NoReturn:
    """A local worker's end, once it has served: as a Python program ends, but quicker.
    The user's atexit functions run, the registers are dropped (each value's finalizer
    runs as its count falls), and every file still open is flushed: a file a function kept
    in a global loses no write (left to the collector, as a cycle through the function's
    globals, CPython may close its buffer before its text layer flushes: bpo-17852).
    Before, a lone worker (an interpreter of its own) ran atexit functions but lost such
    writes, and forked workers (os._exit) lost both. First, as at a program's end (and a
    multiprocessing child's), the user's non-daemon threads are waited for, a thread pool's
    queued work among them: the close's grace bounds that, as it bounds a call still
    running. Not the interpreter's finalization: a lone worker's close took 32 ms with it,
    5 without (benchmarks/close_time.py)."""
    shutdown = getattr(threading, "_shutdown", None)  # CPython's, since 3.0
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()  # joins the non-daemon threads (before, they were cut off unfinished)
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)  # CPython's, since 3.0
    if run_exitfuncs is not None:
        run_exitfuncs()  # (each error printed, as at exit)
    registers.clear()
    files: Iterable[Any] = (  # (and the original streams, where user code replaced them)
        gc.get_objects() if _own_files()
        else (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__))
    for obj in files:  # a look at every object: 5.3 ms, so only where a file may be
        if type(obj) in _FILES:  # (an isinstance of io.IOBase, an ABC: 8.0 ms; the command
            # is in docs/benchmarks.md, "Issue 9, thirty-eighth pass", item 2)
            try:
                obj.flush()
            except Exception:  # closed, or read-only
                pass
    os._exit(0)


_FILES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
"""What ``_end`` flushes: Python's writable files (sys.stdout and sys.stderr among them)."""


def _own_files() -> bool:
    """Whether this process holds an fd that a file object of the user's may write to: one
    past stdin, stdout and stderr that is not unison's own (a memfd, an eventfd, a
    pidfd). A worker that opened nothing skips ``_end``'s look at every object."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return True
    for name in names:
        if int(name) <= 2:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # (the listing's own fd, closed by now)
        if not target.startswith(("/memfd:", "anon_inode:")):
            return True
    return False


def set_niceness(nice: int) -> bool:
    """Run this process at niceness ``nice``; say on stderr when it can't (and go on).

    Ray starts its workers at niceness 15, so that its own daemons come first; a unison
    worker started by a Ray actor inherits that, and on a busy node it would wait behind
    every other process while the controller (niceness 0) spins for its reply: dispatch over
    Ray at N=4 took 226 against 181 us over the same channel without Ray (python
    benchmarks/cluster_bench.py, docs/cluster.md). Raising a niceness
    is always allowed; lowering it needs CAP_SYS_NICE or a high enough RLIMIT_NICE."""
    now = os.getpriority(os.PRIO_PROCESS, 0)
    if now == nice:
        return True
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        print(f"unison worker: could not change this worker's niceness from {now} to {nice} "
              f"(not permitted); it runs at {now}, behind the node's other processes. Ray "
              "starts its workers at 15: start Ray with RAY_worker_niceness=0 in its "
              "environment, or allow lower niceness (CAP_SYS_NICE, or ulimit -e)",
              file=sys.stderr)
        return False
    return True


def connect_main(address: str, rank: int = -1, timeout: float = 60.0,
                 die_with_parent: bool = False, unix: str = "", nice: int | None = None) -> int:
    """``unison worker --connect HOST:PORT``: join a TCP session (unison.channel.tcp) with
    the secret from UNISON_SECRET, fork into keeper and worker as main() does, and serve.

    The lifeline is the connection: when the controller goes, the keeper sees it hang up
    and kills the worker and all it started. With ``die_with_parent`` (a launcher's own
    child, such as a Ray actor's) the keeper also ends it when the process that started
    it ends. A worker on the controller's host (``unix``, the name of the session's Unix
    socket) joins there instead and gets the fds of its shared memory: its traffic then
    goes through the shared-memory channel, and that connection is only its lifeline.
    ``nice``: the niceness to run at (before any thread or the keeper starts), as
    ``set_niceness``."""
    from unison.channel.tcp import Refused, TcpWorkerChannel, dial
    from unison.launch import SECRET_VAR

    _plain_signals()
    if nice is not None:
        set_niceness(nice)

    secret_hex = os.environ.pop(SECRET_VAR, "")  # not left to the user's code, nor to
    # every process it starts
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        wrong = "" if not secret_hex else (  # set, but not to a secret: say what is wrong
            f" ({SECRET_VAR} holds {len(secret_hex)} characters that are not the hex of "
            "16 bytes or more)")
        print(f"unison worker: set {SECRET_VAR} to the session's secret (hex, as the "
              f"controller printed it or gave its launcher){wrong}", file=sys.stderr)
        return 2
    try:
        sock, incarnation, init_blob, fds, spin = dial(address, secret, rank, timeout, unix)
    except (ConnectionError, PermissionError, Refused, ValueError) as exc:
        print(f"unison worker: {exc}", file=sys.stderr)
        return 2
    spec = pickle.loads(init_blob)  # from a controller that proved it holds the secret
    if not isinstance(spec, WorkerSpec):
        print("unison worker: the controller sent no WorkerSpec", file=sys.stderr)
        return 2
    if unix:
        spec = spec.with_fds(fds)
    parent = os.getppid()
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    keeper = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child:
        _keep_remote(child, sock.fileno(), parent if die_with_parent else None, spec.rank)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != keeper:
        os._exit(EXIT_CONTROLLER_GONE)
    run(spec, None if unix else TcpWorkerChannel(sock, incarnation, spin, spec.world_size + 1))
    _end()  # as a local worker ends: an interpreter's finalization with torch.distributed
    # loaded outlasted the keeper's second (an audit, issue 9, forty-ninth pass: each close
    # of a TCP session with collectives="torch" said "its controller hung up" and took 1.1 s)


def _keep_remote(worker: int, lifeline: int, parent: int | None, rank: int) -> NoReturn:
    """The keeper of a TCP worker: it holds a copy of the connection (so the controller
    sees it close only once the worker is gone too) and watches it hang up, its worker end,
    and (``parent``) the process that started it."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    poller = select.poll()
    poller.register(lifeline, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    poller.register(wake_r, select.POLLIN)
    why = ""
    while not why:
        status = _reap(worker)
        if status is not None:
            _kill_below()
            _exit_like(status)
        try:
            events = dict(poller.poll(1000))
        except InterruptedError:
            continue
        if wake_r in events:
            os.read(wake_r, 4096)
        if events.get(lifeline):
            if _reaped_within(worker, 1.0):  # the end of a session: the worker is leaving
                _kill_below()
                os._exit(0)
            why = "its controller hung up"
        elif parent is not None and os.getppid() != parent:
            why = "the process that started it ended"
    try:
        os.write(2, f"unison worker {rank}: {why}; stopping it and everything it "
                    "started\n".encode())
    except OSError:
        pass
    _kill_below()
    os._exit(EXIT_CONTROLLER_GONE)


def _reaped_within(worker: int, seconds: float) -> bool:
    """Whether the worker ends within ``seconds`` (reaped; SIGCHLD cuts each nap short)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _reap(worker) is not None:
            return True
        time.sleep(0.01)
    return _reap(worker) is not None


_HIGH_FDS = 4096
"""Where a worker moves the fds it inherits (``_fds_up_high``), or below that, under a lower
limit on open files: far from the low numbers ordinary opens take."""


def _fds_up_high(spec: WorkerSpec) -> WorkerSpec:
    """The spec with its fds (the channel's, the collectives', the board's) moved up to
    ``_HIGH_FDS``, each keeping its close-on-exec flag. unison uses them by number: at low
    numbers, worker code that closed one (os.closerange, a stray close) had the next file
    it opened take the number, and unison wrote its counters into that file, or mapped it
    as the arena. A soft limit on open files below the spot (1,024 is common, the very
    range an ``os.closerange(3, 1024)`` closes) is raised to it where the hard limit lets
    it; else they go as high as it allows, or stay where they are under a limit too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _HIGH_FDS + 64
    if soft != resource.RLIM_INFINITY and soft < want:
        raised = want if hard == resource.RLIM_INFINITY else min(hard, want)
        if raised > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    base = _HIGH_FDS if soft == resource.RLIM_INFINITY else min(_HIGH_FDS, soft - 64)
    if base < 256 or not spec.fds or len(set(spec.fds)) != len(spec.fds):
        return spec
    moved = []
    for fd in spec.fds:
        inherit = not fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        moved.append(fcntl.fcntl(fd, fcntl.F_DUPFD if inherit else fcntl.F_DUPFD_CLOEXEC, base))
        os.close(fd)
    return spec.with_fds(moved)


def run(spec: WorkerSpec, chan: WorkerChannel | None = None) -> None:
    """Be worker ``spec.rank`` until the controller says stop: import path, affinity and
    identity from the spec, then connect (unless ``chan`` is the connection already) and
    serve. What is launcher-specific (how the spec arrived, what ends us with the
    controller) is done before; main() is the local one, connect_main() the TCP one."""
    spec = _fds_up_high(spec)
    # the controller's path, in its order, then ours: an entry it appended stayed behind
    # the stdlib and site-packages there, and was put before them here (each entry new to
    # us went in front), so a module of its name was another file
    sys.path[:] = [*spec.sys_path, *(p for p in sys.path if p not in spec.sys_path)]
    protocol.forget_deleted_class_attributes()
    if spec.cpus and spec.spread:
        placement.hold(spec.cpus)
    elif spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    _identity.update(rank=spec.rank, world_size=spec.world_size, group=spec.group,
                     group_rank=spec.group_rank, group_size=spec.group_size)
    _debug_stacks.install(spec.rank)  # sess.stacks(): faulthandler on a signal (issue 13)
    _debug_logs.install()  # logging records to the controller, where the launcher relays
    coll = collective.setup(spec.collective, spec.rank, spec.world_size, spec.num_groups,
                            _current)
    global _board
    if spec.cancel >= 0:
        _board = Board(spec.world_size, fd=spec.cancel)
        signal.signal(SIGNAL, _on_cancel_signal)
    if chan is None:
        chan = connect(spec.channel)
    idle = collective.idle_hook()
    if idle is not None:
        chan.on_idle(idle)
    chan.reply(protocol.dumps((protocol.READY_REQ, OK, os.getpid())))
    try:
        serve(chan, coll, _board)
    finally:
        chan.close()
