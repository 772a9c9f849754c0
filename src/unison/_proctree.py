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
