"""Why a button is greyed: the same rules as the API's refusals, judged before anything is sent
(template globals, ``templating.py``); the few words shown beside the button are
``flexium.reasons.short_reason`` (the full reason is its tooltip and is on the job page)."""

from __future__ import annotations

from flexium import protocol, wire


def refusal(process: wire.ProcessInfo, kind: str, actions_refused: str) -> str:
    """Why ``kind`` (migrate, pause or resume) of ``process`` is refused before it is sent; ""
    when it is not. The same rules as the greyed buttons of the table."""
    if actions_refused:
        return actions_refused
    caps = process.capabilities
    able = caps.migration if kind == "migrate" else caps.pause_resume
    if able:
        return ""
    needs = protocol.MIGRATION_MIN_DRIVER if kind == "migrate" else protocol.PAUSE_RESUME_MIN_DRIVER
    return "; ".join(caps.problems) or f"This job's driver cannot {kind} (needs driver {needs}+)"


def job_pause_refusal(job: wire.JobSummary) -> str | None:
    """Why the job's Pause button is greyed beyond its ranks' own problems: ranks of an NCCL job
    sharing a GPU (``protocol.nccl_ranks_on_one_gpu``, as the server refuses the pause)."""
    if not any(rank.capabilities.nccl for rank in job.ranks):
        return None
    placement = {rank.job.rank: rank.gpu_uuid for rank in job.ranks if rank.job is not None}
    return protocol.nccl_ranks_on_one_gpu(placement, restored=set(placement))
