"""How long the server keeps what it records (the audit log by class, GPU history, training
history) and how many dashboard sessions a token holds: the server's settings
(``--audit-access-keep-days`` ...), read where rows are written and pruned.

Like the quotas (``quotas.py``) they ride on the transaction (``Session.info``, set by
``Database.session`` from the server's settings), so that storage functions keep their
signatures; a session without them (a test's) gets ``Settings``' defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium.server.settings import Settings

SESSION_KEY = "flexium_retention"
_DAY = 86400.0


@dataclass(frozen=True)
class Retention:
    access_keep_s: float = Settings.audit_access_keep_days * _DAY  # logins, logouts, refusals
    change_keep_s: float = Settings.audit_change_keep_days * _DAY  # every other audit entry
    history_keep_s: float = Settings.history_keep_days * _DAY  # GPU samples
    progress_keep_s: float = Settings.progress_keep_days * _DAY  # training samples
    sessions_per_token: int = Settings.max_sessions_per_token  # past it a login ends the oldest

    @classmethod
    def of(cls, settings: Settings) -> Retention:
        return cls(
            access_keep_s=settings.audit_access_keep_days * _DAY,
            change_keep_s=settings.audit_change_keep_days * _DAY,
            history_keep_s=settings.history_keep_days * _DAY,
            progress_keep_s=settings.progress_keep_days * _DAY,
            sessions_per_token=settings.max_sessions_per_token,
        )


def retention_of(session: Session) -> Retention:
    found = session.info.get(SESSION_KEY)
    return found if isinstance(found, Retention) else Retention()
