"""Log lines of every process of a service (``--log-level``, ``--log-json``).

Contract:

- JSON (``log_json``): Ray's JSON encoding (``ray.LoggingConfig(encoding="JSON")``), one object per
  line with ``message``, ``levelname``, ``name``, a record's extra fields (the access log's request
  fields) and Ray's context (``node_id``, ``actor_id``, ``worker_id``, ...): for machines.
- TEXT (the default): ``2026-12-01 16:32:05,682 INFO pdserve.access: request r1 stop tenant=- ...``,
  i.e. time, level, logger, message, then the record's extra fields as ``key=value``. Never Ray's
  context ids: Ray's own TEXT encoding appends ``job_id``, ``worker_id``, ``node_id``, ``actor_id``,
  ``task_id``, ``task_name``, ``task_func_name`` and ``timestamp_ns`` to every line (about 600
  characters of ids; see ``ray._common.formatters.TextFormatter`` with ``CoreContextFilter``), so
  TEXT does not use Ray's logging config at all. Ray still names the process in front of each line
  it streams to the driver (``(PrefillWorker pid=1234) ...``), which says where a line comes from.

How TEXT reaches Ray's worker processes: every actor pdserve starts (the workers, the router, the
tensor-parallel ranks) takes a ``log_level`` argument and installs the compact handler first thing
in its constructor (``configure_text_logging``); None (JSON, or an actor built in a test's process)
leaves its logging alone. Not a ``runtime_env`` with Ray's ``worker_process_setup_hook``: any
runtime_env makes Ray start each worker process through its ``setup_worker.py``, which imports Ray
once more before it execs the worker (about 1 s of CPU per process).
"""

from __future__ import annotations

import logging
import sys

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What Ray's CoreContextFilter adds to a record (and its record factory's timestamp): never shown.
RAY_CONTEXT_FIELDS = frozenset({"job_id", "worker_id", "node_id", "actor_id", "actor_name", "task_id", "task_name",
                                "task_func_name", "timestamp_ns"})  # fmt: skip
# The attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD_FIELDS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


# Control characters (and Unicode's line separators) as escapes: a value a client chose (a path, a
# header) must not end a line and forge the next one, nor drive the reader's terminal.
_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def escape_controls(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\n``, ``\\x1b``): one line."""
    return text.translate(_ESCAPES)


class CompactFormatter(logging.Formatter):
    """``TEXT_FORMAT``, then the record's ``extra=`` fields as ``key=value`` (Ray's ids left out).

    A record is one line: control characters of its message and fields are escaped
    (``escape_controls``); only a traceback, which logging appends after, spans lines."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        line = super().formatMessage(record)
        extras = [f"{k}={v}" for k, v in record.__dict__.items()
                  if k not in _STANDARD_FIELDS and k not in RAY_CONTEXT_FIELDS and not k.startswith("_")]  # fmt: skip
        return escape_controls(f"{line} {' '.join(extras)}" if extras else line)


class _PdserveHandler(logging.StreamHandler):
    """The handler ``configure_text_logging`` installs (a type of its own, so a second call
    replaces it instead of adding another)."""


def configure_text_logging(level: str | int) -> None:
    """This process's root logger: one stderr handler with ``CompactFormatter`` at ``level``.

    Idempotent: a handler installed by an earlier call is replaced; other handlers (pytest's,
    the user's) are left alone.
    """
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _PdserveHandler)]:
        root.removeHandler(h)
    handler = _PdserveHandler(sys.stderr)
    handler.setFormatter(CompactFormatter())
    root.addHandler(handler)
    root.setLevel(level)


def text_log_level() -> str | None:
    """The level of the handler ``configure_text_logging`` installed in this process, None if it
    installed none: what this process passes on to the actors it starts, so that they log as it does."""
    root = logging.getLogger()
    if any(isinstance(h, _PdserveHandler) for h in root.handlers):
        return logging.getLevelName(root.level)
    return None
