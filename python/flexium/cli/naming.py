"""How a person names a process on the command line: its id, a unique prefix of one, or its pid
(ids are long to type)."""

from __future__ import annotations

import re

from flexium.client import ApiClient, NotFound

PROCESS_HELP = "process id (gpu-...), a unique prefix of one, or its pid; a rank of a job of several stands for its job"


# A process id whole, as flexium.init() makes them (api/runtime.py).
_MADE_ID = re.compile(r"gpu-[0-9a-f]{8}")


def process_id_for(api: ApiClient, text: str) -> str:
    """The id to send for ``text``: itself when it is a whole id as flexium makes them, else the one it
    stands for, looked up first, so that the server hears of no command for a process that is not there
    (its audit log would show it refused)."""
    return text if _MADE_ID.fullmatch(text) else resolve_process(api, text)


def resolve_process(api: ApiClient, text: str) -> str:
    """The process id ``text`` stands for (itself where a process has that id); NotFound names what it
    matched."""
    listed = api.list_processes()
    if any(p.process_id == text for p in listed):
        return text
    matches = [
        p.process_id
        for p in listed
        if p.process_id.startswith(text) or p.process_id == f"gpu-{text}" or (text.isdigit() and str(p.pid) == text)
    ]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NotFound(
            f"no process {text!r} in workspace '{api.workspace}' (`flexium ps` lists them)",
            code="not_found",
            status=404,
        )
    raise NotFound(f"{text!r} matches several processes: {', '.join(sorted(matches))}", code="not_found", status=404)
