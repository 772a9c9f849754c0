"""Process trees from /proc, without psutil: who descends from a process, and killing them all.

A process started with ``start_new_session=True`` leaves its parent's process group, so
``killpg`` misses it; only the parent links still find it. Those links are read while the
ancestor is alive: once a parent dies, its children belong to a subreaper or to init.
"""

from __future__ import annotations

import os
import signal


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children first, then theirs), read from /proc."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(root: int, include_root: bool = True) -> list[int]:
    """SIGKILL ``root`` (if asked) and every process below it, found first while it lives;
    returns the pids signalled. Nothing is waited for."""
    pids = descendants(root)
    if include_root:
        pids.insert(0, root)
    kill_all(pids)
    return pids


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of ``pids``, where it is still there."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot: /proc stat's 22nd field), or
    None where there is no such process. With its pid it names one process for good: the
    pid alone is handed out again once the process is reaped (pid_max is 32,768 on many
    machines), so a signal sent by pid later needs ``same`` first."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def same(pid: int, start: int | None) -> bool:
    """Whether ``pid`` is still the process that started at ``start`` (``started``). An
    unknown ``start`` (no /proc when it was read) is taken as the same. The pid can only
    change hands between this look and a signal if the process ends, is reaped, and the
    kernel comes round to its number in that moment."""
    return start is None or started(pid) == start
