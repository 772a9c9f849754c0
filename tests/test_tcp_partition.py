"""A silent death: the worker's host vanishes from the network with no FIN and no RST (a power
cut, a pulled cable). Only the TCP channel's heartbeat (an empty frame every 0.25 s that the
kernel must see acknowledged within TCP_USER_TIMEOUT) can tell; WorkerDied must come within
2 s (issue 12): 1.0 s measured.

The worker runs in a network namespace of its own, joined to ours by a veth pair; taking
its end of the pair down is the pulled cable. Needs root and iproute2 (skipped otherwise).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

import unison
from unison import WorkerDied
from unison.launch.connect import ConnectLauncher

pytestmark = pytest.mark.timeout(120)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Host:
    """A namespace at ``peer``, reachable from ours at ``addr``."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.ns, self.here, self.there = f"unison-t{tag}", f"uh{tag}", f"ut{tag}"
        self.addr, self.peer = "10.231.99.1", "10.231.99.2"
        _ip("netns", "add", self.ns)
        try:
            _ip("link", "add", self.here, "type", "veth", "peer", "name", self.there)
            _ip("link", "set", self.there, "netns", self.ns)
            _ip("addr", "add", f"{self.addr}/30", "dev", self.here)
            _ip("link", "set", self.here, "up")
            _ip("netns", "exec", self.ns, "ip", "addr", "add", f"{self.peer}/30", "dev",
                self.there)
            _ip("netns", "exec", self.ns, "ip", "link", "set", self.there, "up")
        except BaseException:
            self.remove()
            raise

    def cut(self) -> None:
        _ip("netns", "exec", self.ns, "ip", "link", "set", self.there, "down")

    def remove(self) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.here], capture_output=True, timeout=30)


@pytest.fixture
def host() -> Iterator[Host]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a network namespace")
    try:
        h = Host()
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot make a network namespace here: {exc}")
    yield h
    h.remove()


@pytest.mark.parametrize("stalled", [False, True])
def test_a_host_that_vanishes_silently_gives_worker_died_within_2_s(host, stalled):
    """``stalled``: the worker busy in a call with more queued for it than the buffers hold
    (its window closed, a put waiting for room) when its host goes: nothing is in flight
    then, only the kernel's window probes, unanswered."""
    workers: list[subprocess.Popen[bytes]] = []

    def start_there(address: str, secret: bytes) -> None:
        env = dict(os.environ, UNISON_SECRET=secret.hex())
        workers.append(subprocess.Popen(
            ["ip", "netns", "exec", host.ns, sys.executable, "-m", "unison", "worker",
             "--connect", address], env=env))

    sess = unison.Session(1, launcher=ConnectLauncher(bind=host.addr, announce=start_there),
                          start_timeout=60)
    try:
        assert sess.run(unison.rank) == [0]
        ref = sess.call(time.sleep, 60)
        errors: list[BaseException] = []
        if stalled:
            def put() -> None:
                try:
                    sess.put(b"x" * (32 << 20))
                except BaseException as exc:
                    errors.append(exc)

            putter = threading.Thread(target=put, daemon=True)
            putter.start()
            time.sleep(1.0)  # the window closed, the put waits for room
            assert putter.is_alive()
        time.sleep(0.2)
        host.cut()
        start = time.monotonic()
        # (stalled: the put's thread may hear of it first; the gather then says it closed)
        with pytest.raises((WorkerDied, unison.SessionClosed),
                           match="acknowledged nothing") as info:
            ref.gather(timeout=30)
        took = time.monotonic() - start
        assert took < 2.0, f"WorkerDied came {took:.2f} s after the cable was pulled"
        if stalled:
            putter.join(10)
            assert errors and isinstance(errors[0], (WorkerDied, unison.SessionClosed)), errors
            assert "acknowledged nothing" in str(errors[0])
        else:
            assert isinstance(info.value, WorkerDied) and info.value.worker == 0
    finally:
        sess.close(timeout=0)
        for w in workers:  # cut off, it never hears the session end: stop it here
            w.kill()
            w.wait(10)
        subprocess.run(["pkill", "-9", "-f", f"--connect {host.addr}:"], capture_output=True)
