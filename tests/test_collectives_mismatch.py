"""Ranks that call different collectives in the same call: every rank raises CollectiveError
naming both operations (never a silently wrong value), and the session stays usable. The
same holds for the torch backend, where a mismatch would otherwise reach gloo and abort the
worker (SIGABRT)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import unison
from unison import CollectiveError

QUICK = 30.0  # a hang shows up as TimeoutError instead of stalling the run


def run_spec(spec: tuple[Any, ...]) -> Any:
    """Run one collective described by ``spec``: (kind, *arguments)."""
    kind, *args = spec
    r = unison.rank()
    if kind == "allreduce":
        return unison.allreduce(np.full(4, r + 1.0), *args)
    if kind == "reduce_scatter":
        return unison.reduce_scatter(np.full(4, r + 1.0), *args)
    if kind == "allgather":
        return unison.allgather(np.full(4, r + 1.0))
    if kind == "broadcast":
        return unison.broadcast(f"from {r}", *args)
    if kind == "scatter":
        return unison.scatter([f"{r}->{j}" for j in range(unison.world_size())], *args)
    if kind == "gather":
        return unison.gather(f"from {r}", *args)
    if kind == "barrier":
        return unison.barrier()
    if kind == "torch-allreduce":
        import torch

        shape, dtype, op = args
        return unison.allreduce(torch.ones(shape, dtype=getattr(torch, dtype)), op)
    if kind == "torch-allgather":
        import torch

        return unison.allgather(torch.ones(args[0]))
    if kind == "torch-broadcast":
        import torch

        return unison.broadcast(torch.ones(4), args[0])
    raise AssertionError(kind)


def mismatched(specs: list[tuple[Any, ...]]) -> tuple[str, str]:
    """Rank r runs specs[r]; returns ("CollectiveError", message) or ("ok", repr)."""
    try:
        return "ok", repr(run_spec(specs[unison.rank()]))
    except CollectiveError as exc:
        return "CollectiveError", str(exc)


def allreduce_ranks() -> list[float]:
    return unison.allreduce(np.array([unison.rank() + 1.0])).tolist()


def torch_allreduce_ranks() -> list[float]:
    import torch

    return unison.allreduce(torch.tensor([unison.rank() + 1.0])).tolist()


MISMATCHES = [
    ([("allreduce", "sum"), ("allgather",)], ["allreduce(op='sum')", "allgather()"]),
    ([("allreduce", "sum"), ("allreduce", "max")], ["op='sum'", "op='max'"]),
    ([("allreduce", "sum"), ("reduce_scatter", "sum")], ["allreduce", "reduce_scatter"]),
    ([("barrier",), ("allreduce", "sum")], ["barrier()", "allreduce(op='sum')"]),
    ([("broadcast", 0), ("broadcast", 1)], ["broadcast(src=0)", "broadcast(src=1)"]),
    ([("scatter", 0), ("scatter", 1)], ["scatter(src=0)", "scatter(src=1)"]),
    ([("gather", 0), ("gather", 1)], ["gather(dst=0)", "gather(dst=1)"]),
    ([("scatter", 0), ("gather", 0)], ["scatter(src=0)", "gather(dst=0)"]),
    ([("allgather",), ("broadcast", 0)], ["allgather()", "broadcast(src=0)"]),
]


@pytest.mark.parametrize(("specs", "names"), MISMATCHES,
                         ids=[" vs ".join(n) for _, n in MISMATCHES])
def test_every_rank_raises_naming_both_operations(shared, specs, names):
    sess = shared(2)
    got = sess.run(mismatched, specs, timeout=QUICK)
    for r, (kind, message) in enumerate(got):
        assert kind == "CollectiveError", f"worker {r} returned {message} silently"
        for name in names:
            assert name in message, (r, message)
    assert sess.run(allreduce_ranks, timeout=QUICK) == [[3.0], [3.0]]  # still usable


def mean_of(kind: str, dtypes: list[str], n: int) -> tuple[str, str]:
    """Rank r's mean (allreduce or reduce_scatter) of n ones of dtypes[r]; as
    ``mismatched``."""
    try:
        got = getattr(unison, kind)(np.ones(n, dtypes[unison.rank()]), "mean")
        return "ok", str(got.dtype)
    except CollectiveError as exc:
        return "CollectiveError", str(exc)


@pytest.mark.parametrize("dtypes", [["int32", "int64"], ["float16", "float32"],
                                    ["int64", "float64"]])
@pytest.mark.parametrize(("kind", "n"), [("allreduce", 4), ("reduce_scatter", 4),
                                         ("reduce_scatter", 4_300_000)],
                         ids=["allreduce", "reduce_scatter", "reduce_scatter-rounds"])
def test_a_mean_of_another_dtype_on_a_peer_raises(shared, dtypes, kind, n):
    """A mean converts what it sums (integers to float64, float16 to float32): the signature
    was taken after, so ranks of different dtypes looked alike and were reduced together,
    each getting a mean of its own dtype (a reduce_scatter past a slot, 32 MiB once
    converted, goes through allreduce's rounds: the signature must go with it)."""
    sess = shared(2)
    got = sess.run(mean_of, kind, dtypes, n, timeout=QUICK)
    assert [kind for kind, _ in got] == ["CollectiveError"] * 2, got
    assert all("another shape or dtype" in message for _, message in got), got
    assert sess.run(allreduce_ranks, timeout=QUICK) == [[3.0], [3.0]]  # still usable


def in_scope(kind: str, groups: list[bool]) -> tuple[str, str]:
    """Rank r runs ``kind`` with group=groups[r]; returns as ``mismatched`` does."""
    r = unison.rank()
    group = groups[r]
    try:
        if kind == "allreduce":
            return "ok", repr(unison.allreduce(np.full(4, r + 1.0), group=group))
        if kind == "allgather":
            return "ok", repr(unison.allgather(r, group=group))
        return "ok", repr(unison.barrier(group=group))
    except CollectiveError as exc:
        return "CollectiveError", str(exc)


@pytest.mark.parametrize("kind", ["allreduce", "allgather", "barrier"])
@pytest.mark.parametrize("pure", [False, True], ids=["native", "pure"])
def test_ranks_that_disagree_on_group_raise_instead_of_hanging(make_session, kind, pure):
    """With one group, the group holds every rank but keeps a counter of its own: a rank
    that called with group=True waited at the group's meeting for a peer that waited at
    the world's for it, for good. Each now sees the other wait at a meeting of the other
    scope that includes it, and raises naming both."""
    sess = make_session(2, env={r: {"UNISON_PURE": "1" if pure else ""} for r in range(2)})
    for groups in ([False, True], [True, False]):
        started = time.monotonic()
        got = sess.run(in_scope, kind, groups, timeout=QUICK)
        assert time.monotonic() - started < 5, got
        for r, (outcome, message) in enumerate(got):
            assert outcome == "CollectiveError", f"worker {r} returned {message} silently"
            assert "group=True" in message and "group=False" in message, (r, message)
            assert f"{kind}(" in message, (r, message)
    assert sess.run(allreduce_ranks, timeout=QUICK) == [[3.0], [3.0]]  # still usable


def test_a_rank_that_calls_its_group_among_world_callers_raises_every_rank(shared):
    """Four ranks in two groups: worker 1 calls group=True, the others the world's. Worker 0
    (in its group) and worker 1 wait for each other; workers 2 and 3 for worker 1."""
    sess = shared(4, num_groups=2)
    got = sess.run(in_scope, "allreduce", [False, True, False, False], timeout=QUICK)
    assert [outcome for outcome, _ in got] == ["CollectiveError"] * 4, got
    assert all("group=True" in m for _, m in got[:2]), got
    assert all("worker 1 left the call" in m for _, m in got[2:]), got


def test_three_ranks_where_one_differs(shared):
    sess = shared(3)
    specs = [("allreduce", "sum"), ("allreduce", "sum"), ("allgather",)]
    got = sess.run(mismatched, specs, timeout=QUICK)
    assert [kind for kind, _ in got] == ["CollectiveError"] * 3, got
    assert all("allgather" in m and "allreduce" in m for _, m in got), got
    assert sess.run(allreduce_ranks, timeout=QUICK) == [[6.0]] * 3


TORCH_MISMATCHES = [
    [("torch-allreduce", (4,), "float32", "sum"), ("torch-allreduce", (5,), "float32", "sum")],
    [("torch-allreduce", (4,), "float32", "sum"), ("torch-allreduce", (4,), "float64", "sum")],
    [("torch-allreduce", (4,), "float32", "sum"), ("torch-allreduce", (4,), "float32", "max")],
    [("torch-allgather", (3,)), ("torch-allgather", (2, 2))],
    [("torch-broadcast", 0), ("torch-broadcast", 1)],
    [("torch-allreduce", (4,), "float32", "sum"), ("torch-allgather", (4,))],
]


@pytest.mark.parametrize("specs", TORCH_MISMATCHES,
                         ids=["shape", "dtype", "op", "allgather-shape", "root", "kind"])
def test_torch_backend_mismatch_raises_instead_of_aborting(shared, specs):
    pytest.importorskip("torch.distributed")
    sess = shared(2, collectives="torch")
    got = sess.run(mismatched, specs, timeout=120)
    for r, (kind, message) in enumerate(got):
        assert kind == "CollectiveError", f"worker {r} returned {message} silently"
    assert sess.run(torch_allreduce_ranks, timeout=120) == [[3.0], [3.0]]  # still usable


def delay_after_next_wait(slow: int, delay: float) -> None:
    """On worker ``slow``, the next collective wait, once it is over, pauses ``delay`` s
    before the rank checks what its peers called: a preemption at the worst moment."""
    if unison.rank() != slow:
        return
    from unison.collective.shm import ShmCollectives

    plain = ShmCollectives._await

    def late(self: ShmCollectives, *args: Any) -> None:
        plain(self, *args)
        ShmCollectives._await = plain  # type: ignore[method-assign]
        time.sleep(delay)

    ShmCollectives._await = late  # type: ignore[method-assign]


@pytest.mark.parametrize("spec", [("barrier",), ("scatter", 0), ("gather", 1)],
                         ids=["barrier", "scatter", "gather"])
def test_a_late_reader_never_sees_the_next_calls_collective(shared, spec):
    """A collective with one meeting (barrier, scatter, gather) can end a call while a peer
    has yet to check what the others called. Worker 0 goes on to the next call's first
    collective; it must not overwrite its record under worker 1, which would then raise a
    mismatch that never was (or, with another record, miss one that was)."""
    sess = shared(2)
    sess.call(delay_after_next_wait, 1, 0.2)
    first = sess.call(mismatched, [spec] * 2)
    then = sess.call(allreduce_ranks)
    assert [kind for kind, _ in first.gather(timeout=QUICK)] == ["ok", "ok"], first.gather()
    assert then.gather(timeout=QUICK) == [[3.0], [3.0]]
