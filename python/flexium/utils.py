"""flexium.utils: the capability check (docs/guide/api.md, "`flexium.utils`: what this machine allows")."""

from __future__ import annotations

from typing import Any

from flexium.engine.capabilities import detect

__all__ = ["get_capabilities", "supports_migration"]


def get_capabilities() -> dict[str, Any]:
    """driver_version, pause_resume and migration, plus why a feature is off ("problems")."""
    return detect().to_dict()


def supports_migration() -> bool:
    return detect().migration
