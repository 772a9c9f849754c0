"""``bare``: the floor for starting N workers (issue 9): N fresh interpreters that import
what a worker needs (``python -c "import numpy, cloudpickle"``), started at once and waited
for. A session's start is read against it, same run: it cannot start faster than its
workers' interpreters do."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from harness.systems.base import System

IMPORTS = "import numpy, cloudpickle"


class BareSystem(System):
    name = "bare"
    description = f'N x `python -c "{IMPORTS}"` started at once, until all have exited'
    workloads = frozenset({"start"})

    def start(self, n: int) -> None:
        procs = [subprocess.Popen([sys.executable, "-c", IMPORTS]) for _ in range(n)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"a bare interpreter failed: exit codes {codes}")

    def dispatch(self) -> None:
        pass  # nothing runs: the start is the whole measurement

    def call(self, fn: Callable[..., object], args: Sequence[Any]) -> None:
        raise NotImplementedError("bare only starts interpreters")

    def gather_small(self) -> list[int]:
        raise NotImplementedError("bare only starts interpreters")

    def put(self, value: Any) -> None:
        raise NotImplementedError("bare only starts interpreters")

    def hold(self, nbytes: int) -> None:
        raise NotImplementedError("bare only starts interpreters")

    def fetch(self) -> list[Any]:
        raise NotImplementedError("bare only starts interpreters")

    def worker_pids(self) -> list[int]:
        return []

    def close(self, graceful: bool = True) -> None:
        pass
