"""What the controller sends the workers, by name: thin entry points into model.py.

A module function travels to the workers by reference (module and name), so the controller
has to import the module that defines it. These import model.py, and torch with it, only when
a worker runs them: the controller of ``unison demo`` never loads torch for the workers' sake.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from unison.demo.model import Shard


def open_shard(path: str, tp: int, device: str = "cpu", threads: int | None = None) -> Shard:
    """This worker's empty shard (model.open_shard)."""
    from unison.demo import model

    return model.open_shard(path, tp, device, threads)


def load_part(shard: Shard, part: int) -> int:
    """Read one part of the worker's shard; the bytes read (model.load_part)."""
    return shard.load(part)


def encode(shard: Shard, ids: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
    """One padded batch through the group (model.encode)."""
    from unison.demo import model

    return model.encode(shard, ids, mask)
