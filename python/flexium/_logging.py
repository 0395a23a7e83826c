"""The package logger: "flexium" and its children print to stderr with a "[flexium] " prefix.

The handler sits on the "flexium" logger with propagation off, as transformers does for its own
logger: flexium's few messages (migrations, recoveries, degraded mode) must reach the terminal
even when the training script never configures logging, and must not print twice when it does.
Set `logging.getLogger("flexium").propagate = True` to route them into your own handlers.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, TextIO

__all__ = [
    "LOGGER_NAME",
    "PREFIX",
    "DEFAULT_LEVEL",
    "LEVEL_NAMES",
    "logger",
    "get_logger",
    "configure_logging",
    "normalize_level",
]

LOGGER_NAME = "flexium"
PREFIX = "[flexium] "
DEFAULT_LEVEL = "INFO"

# Python's level names; WARN and FATAL are its aliases and are reported under the canonical name.
LEVEL_NAMES: dict[str, str] = {
    "CRITICAL": "CRITICAL",
    "FATAL": "CRITICAL",
    "ERROR": "ERROR",
    "WARNING": "WARNING",
    "WARN": "WARNING",
    "INFO": "INFO",
    "DEBUG": "DEBUG",
    "NOTSET": "NOTSET",
}

logger = logging.getLogger(LOGGER_NAME)


def normalize_level(name: str) -> str | None:
    """The canonical level name for `name` (any case, surrounding blanks ignored), or None."""
    return LEVEL_NAMES.get(name.strip().upper())


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        label = "" if record.levelno == logging.INFO else f"{record.levelname}: "
        return "\n".join(f"{PREFIX}{label}{line}" if line else PREFIX.rstrip() for line in message.split("\n"))


if TYPE_CHECKING:
    _StreamHandler = logging.StreamHandler[TextIO]
else:  # not subscriptable at run time before Python 3.11
    _StreamHandler = logging.StreamHandler


class _StderrHandler(_StreamHandler):
    """Writes to whatever sys.stderr is at emit time, so redirection and pytest capture work."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def _ensure_handler() -> None:
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_Formatter())
        logger.addHandler(handler)
        logger.propagate = False


def get_logger(name: str | None = None) -> logging.Logger:
    """The package logger, or its child "flexium.<name>"."""
    _ensure_handler()
    return logger if not name else logger.getChild(name)


def configure_logging(level: str | int | None = None) -> logging.Logger:
    """Set the package log level (a Python level name in any case, or a number).

    None keeps the level already set (FLEXIUM_LOG_LEVEL at import, else INFO). flexium.init()
    passes the resolved `FlexiumConfig.log_level`, which validates FLEXIUM_LOG_LEVEL properly.
    """
    _ensure_handler()
    if level is None:
        return logger
    if isinstance(level, bool) or not isinstance(level, (str, int)):
        raise TypeError(f"log level must be a level name such as 'DEBUG' or a number, not {level!r}")
    if isinstance(level, str):
        canonical = normalize_level(level)
        if canonical is None:
            raise ValueError(f"unknown log level {level!r}; use one of {', '.join(sorted(set(LEVEL_NAMES.values())))}")
        level = canonical
    logger.setLevel(level)
    return logger


def _initial_level() -> str:
    # An invalid value is ignored here on purpose: load_config() rejects it with a proper message,
    # and importing flexium must never fail because of an environment variable.
    return normalize_level(os.environ.get("FLEXIUM_LOG_LEVEL", "")) or DEFAULT_LEVEL


_ensure_handler()
if logger.level == logging.NOTSET:
    logger.setLevel(_initial_level())
