"""The collectives' seams, without workers: both backends implement one interface, share one
set of checks (collective/checks.py), and raise the one CollectiveError of unison.errors."""

from __future__ import annotations

import ast
import inspect

import numpy as np
import pytest

import unison
from unison import errors
from unison.collective import base, checks, shm
from unison.collective import torch as torch_backend

# -- one interface, one error ----------------------------------------------------------------


def test_both_backends_implement_the_collectives_interface():
    for backend in (shm.ShmCollectives, torch_backend.TorchCollectives):
        assert issubclass(backend, base.Collectives)
        assert not inspect.isabstract(backend), backend


def test_collective_error_is_one_class_under_unison_error():
    from unison.collective import CollectiveError

    assert CollectiveError is errors.CollectiveError is unison.CollectiveError
    assert issubclass(CollectiveError, unison.UnisonError)


def test_every_public_error_is_exported():
    public = {name for name, obj in vars(errors).items()
              if isinstance(obj, type) and issubclass(obj, BaseException)}
    assert public == set(errors.__all__)
    assert public <= set(unison.__all__)


def test_the_torch_backend_imports_no_private_name_of_the_shm_backend():
    tree = ast.parse(inspect.getsource(torch_backend))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "unison.collective.shm":
            assert all(not alias.name.startswith("_") for alias in node.names)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            assert not (node.value.id == "shm" and node.attr.startswith("_"))


# -- argument checks -------------------------------------------------------------------------


@pytest.mark.parametrize("op", checks.OPS)
def test_check_op_takes_every_reduction(op):
    assert checks.check_op(op) == op


@pytest.mark.parametrize("op", ["add", None, ["sum"], 1])
def test_check_op_names_the_valid_ops(op):
    with pytest.raises(ValueError, match="op must be one of"):
        checks.check_op(op)


def test_member_maps_a_scope_rank_to_a_global_rank():
    assert checks.member((4, 5, 6, 7), 2, True, "src") == 6
    assert checks.member((0, 1), np.int64(1), False, "dst") == 1


@pytest.mark.parametrize("r", [-1, 4, True, 1.0, "0", None])
def test_member_refuses_what_is_not_a_rank_of_the_scope(r):
    with pytest.raises(ValueError, match=r"is not a rank of the group \(0..3\)"):
        checks.member((4, 5, 6, 7), r, True, "src")


def test_check_members_names_the_missing_workers():
    checks.check_members((0, 1, 2), (0, 1), True)
    with pytest.raises(errors.CollectiveError, match=r"needs workers \[0, 1, 2, 3\]"):
        checks.check_members((0, 1), (0, 1, 2, 3), False)


@pytest.mark.parametrize("peer", [-1, 3, 1, "2", 2.0, True, np.int64(1)])
def test_check_peer_refuses_itself_and_ranks_out_of_range(peer):
    with pytest.raises(ValueError, match=r"send needs a destination rank in 0..2 other than 1"):
        checks.check_peer(peer, 1, 3, "send")
    with pytest.raises(ValueError, match=r"recv needs a source rank in 0..2 other than 1"):
        checks.check_peer(peer, 1, 3, "recv")
    assert checks.check_peer(0, 1, 3, "send") == 0


def test_check_peer_takes_a_numpy_integer_as_a_broadcasts_root_does():
    """send and recv refused ``np.int64(2)`` where broadcast, scatter and gather took it."""
    got = checks.check_peer(np.int64(2), 1, 3, "recv")
    assert got == 2 and type(got) is int


def test_check_scatter_values_needs_one_value_per_worker():
    assert checks.check_scatter_values([1, 2], 2) == [1, 2]
    for xs in (None, [1], [1, 2, 3]):
        with pytest.raises(ValueError, match=r"one value per worker \(2\)"):
            checks.check_scatter_values(xs, 2)


# -- what a rank calls, as one word ----------------------------------------------------------


@pytest.mark.parametrize(("args", "text"), [
    (("barrier",), "barrier()"),
    (("allreduce", "sum"), "allreduce(op='sum')"),
    (("reduce_scatter", "mean"), "reduce_scatter(op='mean')"),
    (("broadcast", None, 2), "broadcast(src=2)"),
    (("scatter", None, 0), "scatter(src=0)"),
    (("gather", None, 3), "gather(dst=3)"),
])
def test_a_descriptor_reads_back_as_the_call_that_made_it(args, text):
    assert checks.describe(checks.descriptor(*args)) == text


def test_descriptors_of_different_calls_differ():
    calls = [(k, None, None) for k in checks.KINDS]
    calls += [("allreduce", op, None) for op in checks.OPS]
    calls += [("broadcast", None, r) for r in range(4)]
    words = [checks.descriptor(*c) for c in calls]
    assert len(set(words)) == len(words)


def test_an_unknown_descriptor_says_so():
    assert checks.describe(0xFF).startswith("an unknown collective")


def test_signatures_tell_shapes_and_dtypes_apart_and_fit_in_a_word():
    sigs = {
        checks.array_signature(np.zeros(shape, dtype))
        for shape in [(), (3,), (1, 3), (3, 1)] for dtype in ["<f4", ">f4", "<f8", "<i8"]
    }
    assert len(sigs) == 16
    assert all(0 <= s < 2**64 for s in sigs)
    assert checks.shape_signature((2, 3), "float32") == checks.shape_signature([2, 3], "float32")
    assert checks.shape_signature((2, 3), "float32") < 2**56
