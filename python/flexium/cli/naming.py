"""How a person names a process on the command line: its id, a unique prefix of one, or its pid
(ids are long to type)."""

from __future__ import annotations

from flexium.client import ApiClient, NotFound

PROCESS_HELP = "process id (gpu-...), a unique prefix of one, or its pid; a rank of a job of several stands for its job"


def resolve_process(api: ApiClient, text: str) -> str:
    """The process id ``text`` stands for; NotFound names what it matched."""
    matches = [
        p.process_id
        for p in api.list_processes()
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
