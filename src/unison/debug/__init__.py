"""Seeing inside a session: every worker's stacks (stacks.py), the hang policy (hang.py) and
workers' logging records on the controller (logs.py). See docs/debugging.md."""

from unison.debug.hang import HangError
from unison.debug.stacks import Frame, Stacks, ThreadStack, WorkerStacks

__all__ = ["Frame", "HangError", "Stacks", "ThreadStack", "WorkerStacks"]
