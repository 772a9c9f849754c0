"""unison: one controller drives N worker processes in lockstep (SPMD).

    with unison.Session(num_workers=4) as sess:
        ref = sess.call(fn, *args)   # every worker runs fn; results stay there, behind a Ref
        ref.gather()                 # every worker's value, in rank order
"""

from typing import TYPE_CHECKING, Any

from unison.cancel import Cancelled
from unison.collective import (
    allgather,
    allreduce,
    barrier,
    broadcast,
    gather,
    recv,
    recv_from_prev_group,
    reduce_scatter,
    scatter,
    send,
    send_to_next_group,
)
from unison.debug import HangError
from unison.errors import (
    CancelledError,
    CollectiveError,
    RemoteError,
    SessionClosed,
    UnisonError,
    WorkerDied,
    WorkerError,
)
from unison.refs import Ref
from unison.worker import cancelled, group, group_rank, group_size, rank, world_size

if TYPE_CHECKING:
    from unison.session import Session, View

__version__ = "0.1.0"

__all__ = [
    "Cancelled",
    "CancelledError",
    "CollectiveError",
    "HangError",
    "Ref",
    "RemoteError",
    "Session",
    "SessionClosed",
    "UnisonError",
    "View",
    "WorkerDied",
    "WorkerError",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "cancelled",
    "gather",
    "group",
    "group_rank",
    "group_size",
    "rank",
    "recv",
    "recv_from_prev_group",
    "reduce_scatter",
    "scatter",
    "send",
    "send_to_next_group",
    "world_size",
]


def __getattr__(name: str) -> Any:
    """Session and View, imported on first use: a worker imports this package too, and
    never needs the controller's side (asyncio, the router, the function cache)."""
    if name in ("Session", "View"):
        from unison import session

        value = getattr(session, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'unison' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"Session", "View"})
