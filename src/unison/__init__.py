"""unison: one controller drives N worker processes in lockstep (SPMD).

    with unison.Session(num_workers=4) as sess:
        ref = sess.call(fn, *args)   # every worker runs fn; results stay there, behind a Ref
        ref.gather()                 # every worker's value, in rank order
"""

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
from unison.session import Session, View
from unison.worker import cancelled, group, group_rank, group_size, rank, world_size

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
