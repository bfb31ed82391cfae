"""Logging setup for the daemon: key=value event lines that suit journald (reads env, fstat).

Under systemd (JOURNAL_STREAM names our stderr) lines carry no timestamp,
since journald adds its own, and start with a "<N>" syslog priority prefix
that journald turns into the entry's level (sd-daemon(3), SyslogLevelPrefix=).
Elsewhere each line starts with a local timestamp.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import TextIO

LOGGER_NAME = "placement_supervisor"
# Modules log under "placement_supervisor.*" or their own "supervisor.*" name.
LOGGER_NAMES = (LOGGER_NAME, "supervisor")

# sd-daemon(3): <3> error, <4> warning, <6> info, <7> debug.
_SYSLOG_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


def journal_stream_matches(env: Mapping[str, str], fd: int) -> bool:
    """True when `fd` is the stream systemd connected to the journal.

    JOURNAL_STREAM is "DEVICE:INODE" of that stream; comparing with fstat(fd)
    tells a redirected stderr (`... 2>file` inside the unit) from the journal
    (systemd.exec(5), $JOURNAL_STREAM).
    """
    value = env.get("JOURNAL_STREAM")
    if not value:
        return False
    dev_text, sep, ino_text = value.partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(fd)
        return st.st_dev == int(dev_text) and st.st_ino == int(ino_text)
    except (OSError, ValueError):
        return False


class JournalFormatter(logging.Formatter):
    """`<N>message`: the priority prefix, no timestamp (journald stamps the line)."""

    def format(self, record: logging.LogRecord) -> str:
        priority = _SYSLOG_PRIORITY.get(record.levelno, 6)
        return f"<{priority}>{super().format(record)}"


def setup_logging(
    env: Mapping[str, str] | None = None,
    stream: TextIO | None = None,
    level: int = logging.INFO,
) -> logging.Logger:
    """Configure the package loggers; returns ours. Idempotent (replaces our handler)."""
    out = stream if stream is not None else sys.stderr
    environ = env if env is not None else os.environ
    try:
        fd = out.fileno()
    except (OSError, ValueError, AttributeError):
        fd = -1
    handler = logging.StreamHandler(out)
    if fd >= 0 and journal_stream_matches(environ, fd):
        handler.setFormatter(JournalFormatter("%(message)s"))
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%dT%H:%M:%S")
        )
    handler.set_name("placement_supervisor")
    for name in LOGGER_NAMES:
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            if old.get_name() == "placement_supervisor":
                logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
    return logging.getLogger(LOGGER_NAME)


def format_fields(**fields: object) -> str:
    """`key=value ...` in the order given; values with spaces are quoted (pure)."""
    parts = []
    for key, value in fields.items():
        text = "-" if value is None else str(value)
        if not text or any(ch.isspace() for ch in text) or '"' in text:
            text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
        parts.append(f"{key}={text}")
    return " ".join(parts)
