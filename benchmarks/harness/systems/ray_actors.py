"""``ray`` (only when ``ray`` is importable): one actor per worker; ``ray.get`` on N method
calls; ``put`` passes one ``ray.put`` object to every actor; ``fetch`` returns each actor's
array through the object store. Not run on the machine this was written on."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from harness.systems.base import System
from harness.tasks import make_block, small_value, touch


class _Worker:
    """The actor class behind the ray baseline."""

    def __init__(self) -> None:
        self._held: Any = None
        self._block: Any = None

    def call(self, fn: Callable[..., object], args: Sequence[Any]) -> None:
        fn(*args)

    def run(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def hold(self, value: Any) -> None:
        self._held = value
        touch(value)  # a numpy array from the object store maps it: read it as the others do

    def make(self, nbytes: int) -> None:
        self._block = None
        self._block = make_block(nbytes)

    def fetch(self) -> Any:
        return self._block

    def pid(self) -> int:
        return os.getpid()


class RaySystem(System):
    name = "ray"
    description = "one Ray actor per worker, ray.get on N method calls (local ray.init)"

    def __init__(self) -> None:
        self._ray: Any = None
        self._actors: list[Any] = []

    def start(self, n: int) -> None:
        ray = importlib.import_module("ray")
        self._ray = ray
        ray.init(num_cpus=max(n, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=False)
        actor = ray.remote(num_cpus=0)(_Worker)
        self._actors = [actor.remote() for _ in range(n)]

    def call(self, fn: Callable[..., object], args: Sequence[Any]) -> None:
        self._ray.get([a.call.remote(fn, args) for a in self._actors])

    def gather_small(self) -> list[int]:
        return list(self._ray.get([a.run.remote(small_value) for a in self._actors]))

    def put(self, value: Any) -> None:
        obj = self._ray.put(value)
        self._ray.get([a.hold.remote(obj) for a in self._actors])

    def hold(self, nbytes: int) -> None:
        self._ray.get([a.make.remote(nbytes) for a in self._actors])

    def fetch(self) -> list[Any]:
        return list(self._ray.get([a.fetch.remote() for a in self._actors]))

    def worker_pids(self) -> list[int]:
        return list(self._ray.get([a.pid.remote() for a in self._actors]))

    def close(self, graceful: bool = True) -> None:
        if self._ray is not None:
            self._actors = []
            self._ray.shutdown()
            self._ray = None
