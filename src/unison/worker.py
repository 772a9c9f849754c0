"""The worker: a loop that runs what the controller sends, keeping results in a register file.

    stdin (init, then lifeline) --> main(): sys.path, affinity, identity
    channel.recv() --> message --> frees dropped first
                                   CALL   regs[ref] = fn(*args)    failure -> Failed + unreported
                                   DEFINE fns[id] = loads(pickle)
                                   PUT    regs[ref] = value
                                   GET    reply value (or its error, which then counts as reported)
                                   SYNC   reply unreported errors, then forget them
                                   SHUTDOWN -> return

A thread watches the lifeline: when the controller dies, stdin reaches EOF and the worker
kills its own process group at once, even in the middle of a long call. Ctrl-C is ignored
here (the controller handles it and stops us), so a terminal never shows one traceback per
worker.

Inside a function a worker runs, ``unison.rank()`` and friends say who this worker is.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import threading
from typing import Any

from unison import collective, protocol
from unison.channel import WorkerChannel, connect
from unison.collective.shm import ShmCollectives
from unison.protocol import CALL, DEFINE, ERR, GET, OK, PUT, SHUTDOWN, SYNC, Failed

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
    return len(protocol.registers)


# -- the loop ----------------------------------------------------------------------------------


def serve(chan: WorkerChannel, coll: ShmCollectives | None = None) -> None:
    """Run messages until SHUTDOWN, or until the controller is gone. ``coll`` learns which
    call runs, so that collectives can tell a peer that left the call from a slow one."""
    regs = protocol.registers
    fns: dict[int, Any] = {}
    unreported: dict[int, tuple[Any, ...]] = {}
    loads, dumps = protocol.loads, protocol.dumps
    while True:
        got = chan.recv()
        if got is None:
            return
        msg = loads(got[0])
        bufs = got[1]
        op, frees = msg[0], msg[1]
        if frees:
            for i in frees:
                if regs.pop(i, None) is None:
                    fns.pop(i, None)
        if op == CALL:
            ref_id, fn_id, blob = msg[2], msg[3], msg[4]
            fn = fns.get(fn_id)
            if coll is not None:
                coll.begin(ref_id, msg[5])
            try:
                if isinstance(fn, Failed):
                    raise RuntimeError(
                        f"the function could not be loaded on this worker: {fn.error[2]}. "
                        "Make its module importable here (workers get the controller's "
                        "sys.path and cwd), or define it in the script that drives the session"
                    )
                if blob is None:
                    regs[ref_id] = fn()  # type: ignore[misc]
                else:
                    args, kwargs = loads(blob, bufs)
                    regs[ref_id] = fn(*args, **kwargs)  # type: ignore[misc]
            except BaseException as exc:  # SystemExit and friends from user code are errors too
                err = protocol.pack_error(exc, _name(fn))
                regs[ref_id] = Failed(err)
                unreported[ref_id] = err
            if coll is not None:
                coll.end(ref_id)
        elif op == GET:
            req_id, ref_id = msg[2], msg[3]
            obj = regs.get(ref_id, _MISSING)
            if isinstance(obj, Failed):
                unreported.pop(ref_id, None)
                chan.reply(dumps((req_id, ERR, obj.error)))
            elif obj is _MISSING:
                err = protocol.pack_error(LookupError(f"Ref #{ref_id} is not held here"), "get")
                chan.reply(dumps((req_id, ERR, err)))
            else:
                chan.reply(_reply_value(req_id, ref_id, obj))
        elif op == SYNC:
            if unreported:
                chan.reply(dumps((msg[2], OK, list(unreported.items()))))
                unreported.clear()
            else:
                chan.ack()
        elif op == DEFINE:
            try:
                fns[msg[2]] = loads(msg[3])
            except BaseException as exc:
                fns[msg[2]] = Failed(protocol.pack_error(exc, "loading a function"))
        elif op == PUT:
            try:
                regs[msg[2]] = loads(msg[3], bufs)
            except BaseException as exc:
                err = protocol.pack_error(exc, "loading a put value")
                regs[msg[2]] = Failed(err)
                unreported[msg[2]] = err
        elif op == SHUTDOWN:
            return


_MISSING = object()


def _reply_value(req_id: int, ref_id: int, obj: object) -> bytes:
    try:
        return protocol.dumps((req_id, OK, obj))
    except Exception as exc:
        err = TypeError(
            f"the value of Ref #{ref_id} ({type(obj).__qualname__}) cannot be pickled back to "
            f"the controller: {exc}. Keep it on the worker, or return something picklable."
        )
        return protocol.dumps((req_id, ERR, protocol.pack_error(err, "get")))


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


# -- process set-up ----------------------------------------------------------------------------


def _read_init() -> dict[str, Any]:
    def read_exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = os.read(0, n - len(buf))
            if not chunk:
                os._exit(0)  # the controller went away before we started
            buf += chunk
        return buf

    size = int.from_bytes(read_exact(8), "little")
    init: dict[str, Any] = pickle.loads(read_exact(size))
    return init


def _watch_lifeline(ppid: int) -> None:
    """Exit, taking our process group along, as soon as the controller is gone."""
    while True:
        ready, _, _ = select.select([0], [], [], 1.0)
        if ready:
            try:
                if not os.read(0, 4096):
                    break
            except OSError:
                break
        if os.getppid() != ppid:
            break
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


def main() -> None:
    """Entry point of a worker process (started by a launcher, never by a user)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init = _read_init()
    threading.Thread(
        target=_watch_lifeline, args=(os.getppid(),), name="unison-lifeline", daemon=True
    ).start()
    for path in reversed(init["sys_path"]):
        if path not in sys.path:
            sys.path.insert(0, path)
    if init.get("cpus"):
        os.sched_setaffinity(0, init["cpus"])
    r, n, g = init["rank"], init["world_size"], init["num_groups"]
    gsize = n // g
    _identity.update(rank=r, world_size=n, group=r // gsize, group_rank=r % gsize, group_size=gsize)
    coll = collective.setup(init.get("collective"), r, n, g)
    chan = connect(init["channel"])
    chan.reply(protocol.dumps((protocol.READY_REQ, OK, os.getpid())))
    try:
        serve(chan, coll)
    finally:
        chan.close()
