"""The server's options, in a module that imports nothing heavy (the command's flags are
built from it even where the ``serve`` extra is not installed)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ServeConfig"]


@dataclass(frozen=True)
class ServeConfig:
    """Every knob of ``unison serve`` (the command's flags)."""

    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "unison"
    tp: int = 2
    dp: int = 1
    device: str = "cpu"
    max_batch: int = 64
    batch_window_ms: float = 2.0
    max_queue: int = 1024
    """Inputs (not requests) that may wait for a batch; beyond, 429."""
    max_inputs: int = 256
    """Inputs one request may hold; beyond, 400."""
    max_body_bytes: int = 8 << 20
    max_bodies_bytes: int = 256 << 20
    """Bytes of request bodies the server may hold while they arrive, all requests
    together; beyond, 503 (many slow uploads would otherwise hold connections x
    max_body_bytes: 300 held 584 MB in an audit)."""
    body_timeout: float = 30.0
    """Seconds a request's body may take to arrive; beyond, 408 (a stalled upload)."""
    batch_timeout: float = 60.0
    """A batch that takes longer fails with 503 and the workers are replaced (a hang)."""
    drain_seconds: float = 5.0
    """How long SIGTERM waits for requests in flight before cancelling them."""
    access_log: bool = False

    def check(self) -> None:
        """ValueError naming the flag when the options cannot work together."""
        for name in ("tp", "dp", "max_batch", "max_queue", "max_inputs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(self, name)}")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-mb must allow at least 1 byte, got "
                             f"{self.max_body_bytes / 2**20:g} MiB")
        if self.max_bodies_bytes < self.max_body_bytes:
            raise ValueError(f"--max-bodies-mb ({self.max_bodies_bytes / 2**20:g}) must be at "
                             f"least --max-body-mb ({self.max_body_bytes / 2**20:g}): one "
                             "largest request could never be read")
        # (NaN fails every comparison, so each bound is written as what must hold; inf would
        # hold a lone request until a full batch came, or never time a batch out)
        if not 0 <= self.batch_window_ms <= 60_000:  # (1e300 held one as inf would)
            raise ValueError(f"--batch-window-ms must be a number from 0 to 60000 (a lone "
                             f"request waits that long for a batch), got "
                             f"{self.batch_window_ms}")
        if not 0 < self.batch_timeout < math.inf:
            raise ValueError(f"the batch timeout must be a finite number of seconds > 0, got "
                             f"{self.batch_timeout}")
        if not 0 < self.body_timeout < math.inf:
            raise ValueError(f"--body-timeout must be a finite number of seconds > 0, got "
                             f"{self.body_timeout}")
        if not 0 <= self.drain_seconds < math.inf:
            raise ValueError(f"--drain-seconds must be a finite number >= 0, got "
                             f"{self.drain_seconds}")
        if self.max_inputs > self.max_queue:
            raise ValueError(f"--max-inputs {self.max_inputs} exceeds --max-queue "
                             f"{self.max_queue}: such a request could never be queued")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
