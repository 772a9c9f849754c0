"""Views: sess[i], sess[a:b], sess[-1], sess.group(g). Worker indices are always global
ranks, a view is not indexed again, and a Ref lives only on the workers of its view."""

from __future__ import annotations

import pytest

import unison
from support import recorded


def identity():
    return {
        "rank": unison.rank(),
        "world_size": unison.world_size(),
        "group": unison.group(),
        "group_rank": unison.group_rank(),
        "group_size": unison.group_size(),
    }


def plus(x, y):
    return x + y


@pytest.fixture
def sess4(make_session):
    return make_session(4, num_groups=2)


def test_one_worker_view_runs_on_that_worker_only(sess4):
    assert sess4[2].run(unison.rank) == [2]
    calls = sess4.put([])
    sess4[2].call(list.append, calls, "ran")
    assert calls.gather() == [[], [], ["ran"], []]


def test_slices_hold_global_ranks(sess4):
    view = sess4[1:3]
    assert view.workers == (1, 2)
    assert len(view) == 2
    assert view.run(unison.rank) == [1, 2]
    assert sess4[-2:].run(unison.rank) == [2, 3]
    assert sess4[::2].run(unison.rank) == [0, 2]


@pytest.mark.parametrize("key", [slice(None, None, -1), slice(3, 1, -1), slice(None, None, -2)])
def test_a_slice_in_falling_order_is_refused(sess4, key):
    """A view goes in rank order (its workers, results, scatter, get's default worker):
    ``sess[::-1]`` kept Python's falling order, so ``run`` gave [3, 2, 1, 0] where it
    promised rank order, and ``scatter`` sent worker 0 the last value, without an error."""
    with pytest.raises(ValueError, match="falling order"):
        sess4[key]
    assert sess4[2:1:-1].run(unison.rank) == [2]  # one worker: no order to get wrong


def test_negative_index_counts_from_the_end(sess4):
    assert sess4[-1].run(unison.rank) == [3]
    assert sess4[-4].run(unison.rank) == [0]


def test_groups_are_consecutive_runs_of_ranks(sess4):
    assert sess4.group(0).run(unison.rank) == [0, 1]
    assert sess4.group(1).run(unison.rank) == [2, 3]


def test_identity_inside_workers(sess4):
    assert sess4.run(identity) == [
        {"rank": 0, "world_size": 4, "group": 0, "group_rank": 0, "group_size": 2},
        {"rank": 1, "world_size": 4, "group": 0, "group_rank": 1, "group_size": 2},
        {"rank": 2, "world_size": 4, "group": 1, "group_rank": 0, "group_size": 2},
        {"rank": 3, "world_size": 4, "group": 1, "group_rank": 1, "group_size": 2},
    ]


def test_groups_of_one_worker(make_session):
    sess = make_session(3, num_groups=3)
    assert sess.run(identity)[2] == {
        "rank": 2, "world_size": 3, "group": 2, "group_rank": 0, "group_size": 1,
    }
    assert sess.group(1).run(unison.rank) == [1]


def test_identity_with_a_single_group(sess):
    assert [d["group"] for d in sess.run(identity)] == [0, 0]
    assert [d["group_size"] for d in sess.run(identity)] == [2, 2]


def test_ref_get_takes_a_global_rank_and_defaults_to_the_views_first_worker(sess4):
    ref = sess4[2:4].call(unison.rank)
    assert ref.workers == (2, 3)
    assert ref.get() == 2
    assert ref.get(worker=3) == 3
    assert sess4.group(1).call(unison.rank).get() == 2
    # a negative rank counts from the session's end, as sess4[-1] does (it was refused
    # as "worker -1 does not hold" the Ref)
    assert ref.get(worker=-1) == 3 and ref.get(worker=-2) == 2
    with pytest.raises(ValueError, match="worker 1 does not hold"):
        ref.get(worker=-3)
    with pytest.raises(ValueError, match="out of range"):
        ref.get(worker=-5)


def test_ref_get_of_a_worker_outside_the_view_is_a_value_error(sess4):
    ref = sess4[2:4].call(unison.rank)
    with pytest.raises(ValueError):
        ref.get(worker=0)
    assert ref.gather() == [2, 3]  # nothing was sent, nothing broke


def test_gather_returns_a_list_even_for_one_worker(sess4):
    assert sess4[3].call(unison.rank).gather() == [3]
    assert sess4[3].put("x").gather() == ["x"]


def test_put_scatter_and_sync_on_views(sess4):
    assert sess4[1:3].put(7).gather() == [7, 7]
    assert sess4.group(1).scatter(["g2", "g3"]).gather() == ["g2", "g3"]
    sess4[0].call(plus, 1, 2)
    assert sess4[0].sync() is None
    assert sess4.group(1).sync() is None


class Box:
    def __init__(self, x):
        self.x = x


def unbox(value):
    return value.x if isinstance(value, Box) else value


def test_a_scatter_lands_each_value_on_its_worker_in_one_message_or_one_each(sess4):
    """Plain values go in one message to the view's workers, each keeping its own by its
    rank; where one is not plain, each worker gets a message of its own (that one pickled,
    the plain ones marshalled)."""
    for view, ranks in ((sess4, [0, 1, 2, 3]), (sess4[1:3], [1, 2]), (sess4.group(1), [2, 3])):
        sess4.run(unison.rank)  # carries any frees, which a view's message would send first
        with recorded(sess4._chan, "send") as sent:
            plain = view.scatter([f"r{r}" for r in ranks])
        assert len(sent) == 1, sent
        assert plain.gather() == [f"r{r}" for r in ranks]
        assert view.run(unison.rank) == ranks
        mixed = view.scatter([Box(r) if r % 2 else r for r in ranks])
        assert view.run(unbox, mixed) == ranks


def test_scatter_on_a_view_needs_one_value_per_worker_of_the_view(sess4):
    with pytest.raises(ValueError):
        sess4[1:3].scatter([1, 2, 3, 4])


@pytest.mark.parametrize("make_view", [
    lambda s: s[0],
    lambda s: s[1:3],
    lambda s: s.group(1),
])
def test_a_view_is_not_indexed_again(sess4, make_view):
    view = make_view(sess4)
    with pytest.raises(TypeError):
        view[0]
    with pytest.raises(TypeError):
        view[0:1]


def test_a_ref_on_a_subset_can_feed_calls_on_that_subset(sess4):
    ref = sess4[1:3].scatter([10, 20])
    assert sess4[1:3].run(plus, ref, 1) == [11, 21]
    assert sess4[2].run(plus, ref, 1) == [21]


@pytest.mark.parametrize("target", [
    lambda s: s,          # the whole session
    lambda s: s[0],       # a worker that lacks it
    lambda s: s[2:4],     # a view that only partly overlaps
])
def test_passing_a_ref_to_workers_that_do_not_hold_it_is_a_value_error_at_call_time(
    sess4, target
):
    ref = sess4[1:3].put(5)
    with pytest.raises(ValueError):
        target(sess4).call(plus, ref, 1)
    with pytest.raises(ValueError):
        target(sess4).call(plus, 1, y=[ref])
    # Nothing was sent: the session and the Ref are fine.
    assert ref.gather() == [5, 5]
    assert sess4.run(unison.rank) == [0, 1, 2, 3]


def test_views_of_one_session_share_its_workers(sess4):
    ref = sess4[0:2].scatter(["a", "b"])
    assert sess4[1].run(str.upper, ref) == ["B"]
    assert sess4.group(0).run(str.upper, ref) == ["A", "B"]


def fail(tag):
    raise KeyError(tag)


def test_a_views_sync_raises_its_own_workers_errors_only(sess4):
    """Each error is raised once, by a sync that covers its worker: a view's sync never
    raises an error of a worker outside it, and leaves it for one that covers it."""
    sess4[1].call(fail, "first")
    sess4[1].call(fail, "second")
    with pytest.raises(unison.WorkerError, match="first"):
        sess4[1].sync()
    sess4[0].call(identity)
    sess4[0].sync()  # worker 1's second error is not worker 0's
    with pytest.raises(unison.WorkerError, match="second"):
        sess4.sync()
    sess4.sync()
