"""Why a button is greyed: the same rules as the API's refusals, judged before anything is sent
(template globals, ``templating.py``), and a refusal in the few words shown beside the button
(the full reason is its tooltip and is on the job page)."""

from __future__ import annotations

from flexium import protocol, wire

# Known reasons a process cannot be moved, as the few words shown beside a greyed button. First
# match wins; order: most specific.
_SHORT_REASONS = (
    ("needs a token with role", "read-only login: an admin token can"),
    ("CPU-only build", "CPU-only torch: no GPU memory to move"),
    ("no usable GPU", "torch sees no usable GPU"),
    ("engine is not running", "flexium's engine is off in this job"),
    ("install the NVIDIA driver", "no NVIDIA driver"),
    ("no NVIDIA driver", "no NVIDIA driver"),
    ("failed to initialise", "the NVIDIA driver failed to start"),
    ("is too old", "NVIDIA driver too old (550+ / 580+)"),
    ("lacks the checkpoint API", "driver lacks the checkpoint API (580+)"),
    ("migration to another GPU needs 580+", "this driver pauses only; moving needs 580+"),
    ("cannot be paused or moved as a whole", "its job cannot be moved as a whole"),
    ("cannot take part in a job operation", "a rank cannot take part"),
    ("GPU remapping on restore", "mixed driver versions"),
)
SHORT_REASON_MAX = 60


def short_reason(full: str) -> str:
    """A refusal in at most ``SHORT_REASON_MAX`` characters, for beside a greyed button."""
    for needle, short in _SHORT_REASONS:
        if needle in full:
            return short
    first = full.split(";")[0].split(": ")[0].strip()
    return first if len(first) <= SHORT_REASON_MAX else first[: SHORT_REASON_MAX - 1].rstrip() + "…"


def refusal(process: wire.ProcessInfo, kind: str, actions_refused: str) -> str:
    """Why ``kind`` (migrate, pause or resume) of ``process`` is refused before it is sent; ""
    when it is not. The same rules as the greyed buttons of the table."""
    if actions_refused:
        return actions_refused
    caps = process.capabilities
    able = caps.migration if kind == "migrate" else caps.pause_resume
    if able:
        return ""
    needs = "580+" if kind == "migrate" else "550+"
    return "; ".join(caps.problems) or f"This job's driver cannot {kind} (needs {needs})"


def job_pause_refusal(job: wire.JobSummary) -> str | None:
    """Why the job's Pause button is greyed beyond its ranks' own problems: ranks of an NCCL job
    sharing a GPU (``protocol.nccl_ranks_on_one_gpu``, as the server refuses the pause)."""
    if not any(rank.capabilities.nccl for rank in job.ranks):
        return None
    placement = {rank.job.rank: rank.gpu_uuid for rank in job.ranks if rank.job is not None}
    return protocol.nccl_ranks_on_one_gpu(placement, restored=set(placement))
