"""Workers' ``logging`` records, handled by the controller's logging.

    controller: LocalLauncher.start           worker (run(): install())
    UNISON_LOG_LEVELS={"": 20, "app": 10} --> the same levels on the same loggers; a handler
      (the controller's logger levels,        on the root logger writes each record as one
       at the session's start)                line to stderr: MARK + JSON (name, level,
                                              message with its args applied, file, line,
                                              function, time, thread, exception text)
    the launcher's relay: a line that <------ stderr (the mark may follow a partial line
    holds MARK -> relay(): a LogRecord        the worker left, a progress bar's "\\r 33%|")
    with ``rank``, handed to logging.getLogger(name).handle(), so the controller's handlers
    and format apply

A record is shipped once (by the root logger's handler: records propagate to it), and handled
once on the controller (``handle`` propagates it up the controller's loggers as usual). Where
the controller's logging is not configured at all (no handler on the way to the root),
records at WARNING and above are printed as Python's last-resort handler would, prefixed
with the rank as every other line a worker writes.

Only workers whose stderr the local launcher relays get the handler (the environment
variable says so); a worker that joined over TCP logs to its own stderr, as before.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import sys
from typing import Any, TextIO

__all__ = ["ENV", "MARK", "install", "levels", "parse_levels", "relay"]

ENV = "UNISON_LOG_LEVELS"
MARK = "\x1eunison-log "
"""What starts a shipped record's line (a record separator: never in plain output)."""
LINE_BYTES = 64 * 1024
"""The most a record's line takes, in bytes with its newline: the launcher's relay reads a
marked line whole up to this (unison.launch.local). A longer record has its longest texts
cut, each saying how much it lost."""
_TAIL_FIRST = ("exc_text", "stack_info")
"""The texts whose end is kept where they are cut (a traceback's last lines say most)."""
_FIELDS = ("name", "levelno", "levelname", "pathname", "filename", "module", "lineno",
           "funcName", "created", "msecs", "thread", "threadName", "processName", "process")


def levels() -> str:
    """The controller's logger levels now (the root's effective one and every one set), as
    the worker's environment carries them."""
    root = logging.getLogger()
    out = {"": root.getEffectiveLevel()}
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and logger.level != logging.NOTSET:
            out[name] = logger.level
    return json.dumps(out)


def parse_levels(text: str) -> dict[str, int]:
    """``ENV``'s value as ``levels`` writes it: a JSON object of logger name -> int level.
    ValueError says what is wrong (a value given by hand in a worker's env)."""
    try:
        wanted = json.loads(text)
    except ValueError:
        wanted = None
    if not isinstance(wanted, dict) or not all(
            isinstance(k, str) and type(v) is int for k, v in wanted.items()):
        raise ValueError(f"{ENV} must be a JSON object of logger name to int level, e.g. "
                         f'{{"": 20, "app": 10}} ("" is the root logger), not {text!r}')
    return wanted


class _Ship(logging.Handler):
    """Writes each record as one marked line to the stream the worker started with."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(logging.NOTSET)
        self.stream = stream
        self._fmt = logging.Formatter()
        try:  # non-ASCII text as it is where the stream writes UTF-8, else as \u escapes
            self._ascii = codecs.lookup(getattr(stream, "encoding", None) or "ascii").name \
                != "utf-8"
        except LookupError:
            self._ascii = True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data: dict[str, Any] = {k: getattr(record, k, None) for k in _FIELDS}
            data["msg"] = record.getMessage()
            if record.exc_info and not record.exc_text:
                record.exc_text = self._fmt.formatException(record.exc_info)
            if record.exc_text:
                data["exc_text"] = record.exc_text
            if record.stack_info:
                data["stack_info"] = record.stack_info
            self.stream.write(_line(data, self._ascii))
            self.stream.flush()
        except Exception:
            self.handleError(record)


def _line(data: dict[str, Any], ascii: bool) -> str:
    """The record's marked line, within LINE_BYTES as the stream encodes it: the longest
    texts cut to one length in bytes, the shorter ones whole (a character takes 1 to 12
    bytes, so the cut is measured on the line, then again until it fits)."""
    whole: dict[str, str] = {}
    for key, value in data.items():  # more characters than fit as bytes: no need to look
        if isinstance(value, str) and len(value) > LINE_BYTES:
            whole[key] = value
            data[key] = _cut(key, value, LINE_BYTES)
    for _ in range(64):
        line = MARK + json.dumps(data, default=str, ensure_ascii=ascii) + "\n"
        over = _size(line, ascii) - LINE_BYTES
        if over <= 0:
            return line
        sizes = {k: _size(json.dumps(v, ensure_ascii=ascii), ascii)
                 for k, v in data.items() if isinstance(v, str)}
        level = _level(sorted(sizes.values()), sum(sizes.values()) - over)
        for key, size in sizes.items():
            if size > level:
                now = data[key]  # (the note it may hold is shorter than 48 characters)
                data[key] = _cut(key, whole.setdefault(key, now),
                                 max(0, len(now) * level // size - 48))
    raise ValueError(f"a logging record too large to ship to the controller (over {LINE_BYTES} "
                     "bytes even with its texts cut) was dropped: log fewer or shorter fields "
                     "(extra=, stack_info) in one record")


def _level(sizes: list[int], budget: int) -> int:
    """The most bytes each text may keep for them all to take ``budget``, the shorter ones
    whole (``sizes`` sorted)."""
    left = len(sizes)
    for size in sizes:
        if size * left > budget:
            return max(0, budget // left)
        budget -= size
        left -= 1
    return sizes[-1] if sizes else 0


def _size(text: str, ascii: bool) -> int:
    """Its bytes as the worker's stderr writes it (a lone surrogate: backslash escaped)."""
    return len(text) if ascii else len(text.encode("utf-8", "backslashreplace"))


def _cut(key: str, text: str, keep: int) -> str:
    """``text`` cut to ``keep`` characters (its end for a traceback), saying how many went."""
    if keep >= len(text):
        return text
    note = f"[... {len(text) - keep} characters cut]"
    if key in _TAIL_FIRST:
        return note + "\n" + text[len(text) - keep:]
    return text[:keep] + " " + note


def install() -> None:
    """In a worker started by the local launcher: ship every record the controller's logger
    levels let through (nothing where the environment does not ask for it)."""
    spec = os.environ.pop(ENV, None)  # not for what the worker starts in turn
    if spec is None or sys.stderr is None:
        return
    try:
        wanted = parse_levels(spec)  # the controller checked a value given in env=
    except ValueError:
        return
    root = logging.getLogger()
    if any(isinstance(h, _Ship) for h in root.handlers):
        return
    for name, level in wanted.items():
        logging.getLogger(name or None).setLevel(level)
    root.addHandler(_Ship(sys.stderr))


def relay(rank: int, line: str) -> str | None:
    """On the controller: handle a marked line from worker ``rank`` as a log record there.
    What to keep of it in the worker's stderr tail (for WorkerDied), or None if the line is
    not a record after all (then it is plain output)."""
    try:
        data = json.loads(line[len(MARK):])
        if not isinstance(data, dict):
            return None
        name = str(data.get("name") or "root")
        levelno = int(data.get("levelno", logging.WARNING))
    except (ValueError, TypeError):
        return None
    data["rank"] = rank
    data["args"] = None
    data["exc_info"] = None
    created = data.get("created")
    if isinstance(created, (int, float)):
        data["relativeCreated"] = (created - logging._startTime) * 1000  # type: ignore[attr-defined]
    record = logging.makeLogRecord(data)
    message = str(record.msg)
    if record.exc_text:
        message += "\n" + record.exc_text
    logger = logging.getLogger(None if name == "root" else name)
    if logger.isEnabledFor(levelno):
        if logger.hasHandlers():
            logger.handle(record)
        elif logging.lastResort is not None and levelno >= logging.lastResort.level:
            _print(rank, message)
    return f"{record.levelname}:{name}:{message}"


def _print(rank: int, text: str) -> None:
    """As logging's last-resort handler would print it, but prefixed with the rank."""
    out = sys.stderr
    if out is None:
        return
    try:
        out.write("".join(f"[worker {rank}] {line}\n" for line in text.split("\n")))
        flush = getattr(out, "flush", None)
        if flush is not None:
            flush()
    except Exception:
        pass
