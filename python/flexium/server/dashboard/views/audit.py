"""The audit log's page: the newest entries of the workspace."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium import wire
from flexium.server import storage

AUDIT_SHOWN = 200


@dataclass(frozen=True)
class AuditPage:
    """audit.html."""

    now: float
    keep: str  # how long the workspace keeps its entries
    entries: tuple[wire.AuditEntry, ...]


def audit_page(*, session: Session, workspace_id: int, now: float) -> AuditPage:
    kept = storage.retention_of(session)
    return AuditPage(
        now=now,
        keep=(
            f"changes are kept {kept.change_keep_s / 86400:g} days, logins and refusals {kept.access_keep_s / 86400:g}"
        ),
        entries=tuple(storage.list_audit(session=session, workspace_id=workspace_id, limit=AUDIT_SHOWN)),
    )
