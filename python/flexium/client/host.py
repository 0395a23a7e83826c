"""The host a training process reports and ``flexium run`` places a job on: this machine's host
name, or the simulated host it is told (``flexium.simulated.host_name``, on the simulated driver
only). The server keeps every job to the GPUs of its host."""

from __future__ import annotations

import socket

from flexium import protocol, simulated, wire


def reported_host() -> str:
    name = simulated.host_name() or socket.gethostname()
    return wire.clean_text(name)[: protocol.MAX_HOST_LEN] or "localhost"
