"""The connection to the flexium server.

``ApiClient`` (one request method for everything: the training process and the command line)
and ``ProcessClient`` (the training process's reporter and control threads, started by
``flexium.init()`` through ``start_client`` when a server is configured).
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from flexium import protocol
from flexium.client.http import (
    ApiClient,
    Backoff,
    NotDelivered,
    NotFound,
    Refused,
    ServerError,
    Unauthorized,
    Unavailable,
    Unreachable,
)
from flexium.errors import ConfigError

if TYPE_CHECKING:
    from flexium.client.contracts import EngineControl, TrainingProcess
    from flexium.client.process import ProcessClient

__all__ = [
    "ApiClient",
    "Backoff",
    "EngineControl",
    "NotDelivered",
    "NotFound",
    "ProcessClient",
    "Refused",
    "ServerError",
    "TrainingProcess",
    "Unauthorized",
    "Unavailable",
    "Unreachable",
    "start_client",
]

log = logging.getLogger("flexium.client")

# What only a training process uses is imported when first used (PEP 562): the `flexium` command
# needs ApiClient alone, and the process's side imports the engine (0.1 s a call).
_TRAINING_SIDE = {"EngineControl": "contracts", "TrainingProcess": "contracts", "ProcessClient": "process"}


def __getattr__(name: str) -> Any:
    if name not in _TRAINING_SIDE:
        raise AttributeError(f"module 'flexium.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"flexium.client.{_TRAINING_SIDE[name]}"), name)
    globals()[name] = value
    return value


def start_client(training: TrainingProcess) -> ProcessClient | None:
    """Starts the threads and returns at once: registration happens in the background, and
    an unreachable server only delays it."""
    config = training.config
    if config is None or config.address is None:
        return None
    from flexium import __version__
    from flexium.client.process import ProcessClient

    if not config.token:
        log.warning(
            "no workspace token: the server %s will refuse this process; set %s or 'token:' in .flexiumrc",
            config.address,
            protocol.TOKEN_ENV,
        )
    try:
        api = ApiClient(config.address, config.token, user_agent=f"flexium/{__version__} (process)")
    except ConfigError as exc:  # the job trains on, as without a server, saying why once
        log.error("%s; this process trains without the server %s", exc, config.address)
        return None
    return ProcessClient(training, api).start()
