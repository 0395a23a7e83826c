"""Per-workspace quotas: how much one workspace may keep in the database. Each refusal is a 4xx
that names the limit and the setting that raises it.

The limits ride on the transaction (``Session.info``, set by ``Database.session`` from the
server's settings) so that storage functions keep their signatures; a session without them
(a test's, the admin commands') gets ``Settings``' defaults.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from sqlalchemy import distinct, func, select
from sqlalchemy.orm import Session

from flexium.server.errors import PayloadTooLarge, QuotaExceeded
from flexium.server.models import Device, Process, Token, Workspace
from flexium.server.settings import Settings
from flexium.server.storage.token_validity import token_alive

SESSION_KEY = "flexium_quotas"


@dataclass(frozen=True)
class Quotas:
    max_processes: int = Settings.max_processes
    max_tokens: int = Settings.max_tokens
    max_payload_bytes: int = Settings.max_payload_bytes
    max_gpus_per_host: int = Settings.max_gpus_per_host
    max_hosts: int = Settings.max_hosts

    @classmethod
    def of(cls, settings: Settings) -> Quotas:
        return cls(
            max_processes=settings.max_processes,
            max_tokens=settings.max_tokens,
            max_payload_bytes=settings.max_payload_bytes,
            max_gpus_per_host=settings.max_gpus_per_host,
            max_hosts=settings.max_hosts,
        )


def _quotas(session: Session) -> Quotas:
    found = session.info.get(SESSION_KEY)
    return found if isinstance(found, Quotas) else Quotas()


def _setting(name: str) -> str:
    from flexium.server.settings import option_and_env

    return option_and_env(name)


def _counting_alone(session: Session, workspace_id: int) -> None:
    """Hold the workspace's row until this transaction ends, so that two adds counted at once
    (PostgreSQL; SQLite's writes take turns already) cannot both see room for one more: the
    second counts again once the first has committed. ``NO KEY UPDATE``: the rows that merely
    reference the workspace (every insert's foreign key) are not held up by it."""
    session.execute(select(Workspace.id).where(Workspace.id == workspace_id).with_for_update(key_share=True))


def check_new_process(*, session: Session, workspace_id: int) -> None:
    """Before a process is added to the workspace."""
    limit = _quotas(session).max_processes
    _counting_alone(session, workspace_id)
    count = session.scalar(select(func.count()).select_from(Process).where(Process.workspace_id == workspace_id)) or 0
    if count >= limit:
        raise QuotaExceeded(
            f"the workspace has {count} processes, its limit: stopped ones go {_setting('remove_after_s')} "
            f"after their last heartbeat, or start the server with a higher {_setting('max_processes')}",
            detail={"limit": "max_processes", "value": limit},
        )


def check_new_token(*, session: Session, workspace_id: int, now: float) -> None:
    """Before a token is issued in the workspace (revoked and expired ones do not count)."""
    limit = _quotas(session).max_tokens
    _counting_alone(session, workspace_id)
    count = (
        session.scalar(
            select(func.count()).select_from(Token).where(Token.workspace_id == workspace_id, token_alive(now))
        )
        or 0
    )
    if count >= limit:
        raise QuotaExceeded(
            f"the workspace has {count} tokens neither revoked nor expired, its limit: revoke unused ones "
            f"(`flexium token revoke`), or start the server with a higher {_setting('max_tokens')}",
            detail={"limit": "max_tokens", "value": limit},
        )


def check_new_gpus(*, session: Session, workspace_id: int, host: str, uuids: Collection[str]) -> None:
    """Before a device report stores GPUs its host had none of. A report carries at most
    ``protocol.MAX_DEVICES`` GPUs, but a new UUID in each (or a new host name) would add rows and
    history samples without end, each sent to every dashboard."""
    known = _host_gpus(session, workspace_id, host)
    if known.issuperset(uuids):
        return
    _counting_alone(session, workspace_id)
    known = _host_gpus(session, workspace_id, host)  # again: another report may have added some meanwhile
    limits = _quotas(session)
    count = len(known.union(uuids))
    if count > limits.max_gpus_per_host:
        raise QuotaExceeded(
            f"host {host!r} would have {count} GPUs, over the limit of {limits.max_gpus_per_host}: a GPU no longer "
            f"reported goes {_setting('remove_after_s')} after its last report, or start the server with a higher "
            f"{_setting('max_gpus_per_host')}",
            detail={"limit": "max_gpus_per_host", "value": limits.max_gpus_per_host},
        )
    if known:
        return
    hosts = session.scalar(select(func.count(distinct(Device.host))).where(Device.workspace_id == workspace_id)) or 0
    if hosts >= limits.max_hosts:
        raise QuotaExceeded(
            f"the workspace has GPUs of {hosts} hosts, its limit: a host no longer reported goes "
            f"{_setting('remove_after_s')} after its last report, or start the server with a higher "
            f"{_setting('max_hosts')}",
            detail={"limit": "max_hosts", "value": limits.max_hosts},
        )


def _host_gpus(session: Session, workspace_id: int, host: str) -> set[str]:
    return set(session.scalars(select(Device.uuid).where(Device.workspace_id == workspace_id, Device.host == host)))


def stored_json(*, session: Session, value: BaseModel, what: str) -> Any:
    """``value`` as the JSON to store, when it is within the payload limit. Free-form JSON a
    peer sends (a process's capabilities, a command's result) is stored, sent to every
    dashboard in events and kept in the event history: one limit for all of it, here."""
    data = value.model_dump(mode="json")
    limit = _quotas(session).max_payload_bytes
    size = len(json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    if size > limit:
        raise PayloadTooLarge(
            f"{what} is {size} bytes of JSON, over the limit of {limit}: send less, or start the server "
            f"with a higher {_setting('max_payload_bytes')}",
            detail={"limit": "max_payload_bytes", "value": limit, "size": size},
        )
    return data
