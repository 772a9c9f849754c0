"""The CPU time this process's cgroup allows: a container's ``--cpus``, a Kubernetes pod's
CPU limit, a systemd unit's CPUQuota.

Such a limit is a quota of CPU time per period, not a set of CPUs: the process still sees
every CPU of the host (sched_getaffinity) and runs on as many at once as it likes, until the
quota is spent; then every task of the cgroup waits for the rest of the period.
pacing.pool_cores() shares the quota's CPUs (rounded up) out to the workers' thread pools,
and pacing's crowd does not take those stalls (``throttled``) for strangers holding the core
where our own spinning spent the quota. Taken so, the waits slept, and dispatch at N=1 on 2
CPUs with a quota of one took 8.8 µs a round in wall time against the floor's 3.7 (issue 9,
twenty-seventh pass).

Read as Go's runtime and the JVM read it: the process's cgroup from /proc/self/cgroup, the
hierarchy's mount from /proc/self/mountinfo, and the tightest limit from there up to the
mount's root (a parent's limit binds its children). cgroup v2 (``cpu.max``) and v1
(``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) alike.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["Quota", "quota", "throttled"]


class Quota(NamedTuple):
    """A cgroup's CPU limit: ``cpus`` CPUs' worth of time per period, set on ``directory``
    (whose ``cpu.stat`` counts the periods it stalled its tasks)."""

    cpus: float
    directory: str


def quota(proc: str = "/proc/self") -> Quota | None:
    """The tightest CPU limit on ``proc``'s cgroups, along each path to its hierarchy's
    root; None where nothing limits it (or this is not Linux, or the files cannot be read)."""
    try:
        with open(os.path.join(proc, "cgroup")) as f:
            memberships = f.read().splitlines()
        with open(os.path.join(proc, "mountinfo")) as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    best: Quota | None = None
    for line in mounts:
        found = _mount(line, memberships)
        if found is None:
            continue
        directory, top, read = found
        while True:
            limit = read(directory)
            if limit is not None and (best is None or limit < best.cpus):
                best = Quota(limit, directory)
            up = os.path.dirname(directory)
            if directory == top or up == directory or not up.startswith(top):
                break  # at the mount's root (or, for a path that is not under it, at /)
            directory = up
    return best


def throttled(directory: str) -> tuple[int, int] | None:
    """How often, and for how long in all (ns, summed over the CPUs it stalled), the cgroup
    at ``directory`` has stalled its tasks, their quota spent: ``nr_throttled`` and
    ``throttled_time`` (v1) or ``throttled_usec`` (v2) of its ``cpu.stat``; None if
    unreadable."""
    count = ns = None
    try:
        with open(os.path.join(directory, "cpu.stat"), "rb") as f:
            for line in f:
                key, _, value = line.partition(b" ")
                if key == b"nr_throttled":
                    count = int(value)
                elif key == b"throttled_time":
                    ns = int(value)
                elif key == b"throttled_usec":
                    ns = int(value) * 1000
    except (OSError, ValueError):
        return None
    return None if count is None or ns is None else (count, ns)


def _mount(line: str, memberships: list[str]
           ) -> tuple[str, str, Callable[[str], float | None]] | None:
    """For a mountinfo line of a cgroup hierarchy that has the cpu controller: (the
    process's cgroup directory under it, the mount point, the reader of a directory's
    limit). None for any other mount, or where the process's cgroup is outside it."""
    fields = line.split()
    if "-" not in fields:
        return None
    dash = fields.index("-")
    if len(fields) < dash + 2 or len(fields) < 5:
        return None
    # (the kernel writes a space, tab, line end or backslash in a path as \040, \011, \012
    # or \134: undecoded, a mount point with a space was read as no quota)
    fstype, root, point = fields[dash + 1], _unescape(fields[3]), _unescape(fields[4])
    options = fields[dash + 3].split(",") if len(fields) > dash + 3 else []
    read: Callable[[str], float | None]
    if fstype == "cgroup2":
        path, read = _member(memberships, None), _read_v2
    elif fstype == "cgroup" and "cpu" in options:
        path, read = _member(memberships, "cpu"), _read_v1
    else:
        return None
    if path is None:
        return None
    if root != "/":  # the mount shows only part of the hierarchy (a container's own cgroup)
        if path != root and not path.startswith(root + "/"):
            return None
        path = path[len(root):] or "/"
    return os.path.normpath(point + path), os.path.normpath(point), read


def _member(memberships: list[str], controller: str | None) -> str | None:
    """The process's cgroup path in the v1 hierarchy with ``controller``, or in the v2
    hierarchy (None): /proc/self/cgroup lines read "id:controllers:path"."""
    for line in memberships:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if controller is None and parts[0] == "0" and parts[1] == "":
            return parts[2]
        if controller is not None and controller in parts[1].split(","):
            return parts[2]
    return None


def _read_v2(directory: str) -> float | None:
    """``cpu.max`` reads "max 100000" (no limit) or "<quota> <period>" in µs."""
    try:
        with open(os.path.join(directory, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max" or int(period) <= 0:
        return None
    return int(quota) / int(period)


def _read_v1(directory: str) -> float | None:
    """``cpu.cfs_quota_us`` is -1 where there is no limit."""
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def _unescape(path: str) -> str:
    """A path of /proc/self/mountinfo, its octal escapes decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), path)
