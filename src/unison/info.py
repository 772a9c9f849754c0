"""``unison info``: what this install runs on this machine, in a few lines to paste into a
bug report. Chiefly whether the C fast paths are in use: where they did not build (no
compiler at install time, a wheel from pip's cache built without one) unison falls back to
pure Python in silence, with the same results and a slower round trip (about 1.3x at N=2:
docs/benchmarks.md), and nothing else says so."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sys


def lines() -> list[str]:
    """The report, a line each: the version, the machine, each fast path and why it is not
    in use, the extras installed."""
    import unison
    from unison import _native, pacing
    from unison.channel import shm as channel_shm
    from unison.collective import shm as collective_shm

    out = [f"unison {unison.__version__} ({os.path.dirname(unison.__file__)})",
           f"python {platform.python_version()} ({sys.executable})",
           f"machine: {cpu_model()}, {pacing.cores()} CPU(s) for this process, "
           f"{platform.system()} {platform.release()} {platform.machine()}"]
    if not _native.ordered_memory():
        out.append("memory order: " + _native.unordered_why("shared memory"))
    for name, used, what in (("_ring", channel_shm.NATIVE, "the command ring"),
                             ("_coll", collective_shm._coll is not None, "small allreduces")):
        out.append(f"{what} ({name}): " + ("C" if used else "pure Python, " + _native.unused.get(
            name, "why is unknown")))
    for extra, dists in _extras().items():
        missing = [d for d in dists if not _version(d)]
        out.append(f"extra {extra}: " + (
            "installed" if not missing else "not installed" if len(missing) == len(dists)
            else "missing " + ", ".join(missing)))
    return out


_USED = ("torch", "demo", "serve", "ray")
"""The extras unison's own code uses (the others are for its tests and benchmarks)."""


def _extras() -> dict[str, list[str]]:
    """Each extra of ``_USED``: the distributions it asks for, as the install's metadata
    lists them (another extra it names counts through its own line)."""
    out: dict[str, list[str]] = {name: [] for name in _USED}
    try:
        wants = importlib.metadata.metadata("unison").get_all("Requires-Dist") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree on sys.path
        return {}
    for want in wants:
        extra = re.search(r"""extra == ['"]([\w.-]+)['"]""", want)
        name = re.match(r"[A-Za-z0-9._-]+", want)
        if extra and name and extra[1] in out and name[0] != "unison":
            out[extra[1]].append(name[0])
    return out


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo (or what platform knows): for this report, and the
    demo's."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def main() -> int:
    print("\n".join(lines()))
    return 0
