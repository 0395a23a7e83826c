"""A job's ranks registered out of order (rank 1 first; four ranks shuffled), under process ids
and on GPUs that sort neither by rank nor by registration: a whole-job pause, a resume that moves
some ranks and a migration that swaps them, over HTTP, each command delivered to the process of
the rank it names, with that rank's target. A server that paired commands with ranks in
registration order passed every other server test; the end-to-end suite caught it only when rank 1
happened to register first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from support.server import GIB, Api, rank_body

MEMORY = 10 * GIB


@dataclass(frozen=True)
class Job:
    """``order``: the ranks in the order they register; ``names``: each rank's process id;
    ``gpus``: the GPU index each rank starts on."""

    order: tuple[int, ...]
    names: dict[int, str]
    gpus: dict[int, int]

    @property
    def world(self) -> int:
        return len(self.order)

    def rank_of(self, process_id: str) -> int:
        return next(rank for rank, name in self.names.items() if name == process_id)


# Process ids sort neither by rank nor by registration; no rank starts on the GPU of its own number.
TWO_RANKS = Job(order=(1, 0), names={0: "node1-w-beta", 1: "node1-w-alpha"}, gpus={0: 3, 1: 1})
FOUR_RANKS = Job(
    order=(2, 0, 3, 1),
    names={0: "node1-w-delta", 1: "node1-w-alpha", 2: "node1-w-charlie", 3: "node1-w-bravo"},
    gpus={0: 2, 1: 0, 2: 3, 3: 1},
)
# Per case: the resume's ranks (rank -> GPU index; the others stay where they paused), then the
# migration's (a swap among them).
MOVES = {
    "rank-1-first": (TWO_RANKS, {1: 0}, {0: 0, 1: 3}),
    "four-ranks-shuffled": (FOUR_RANKS, {3: 2, 0: 1}, {1: 3, 2: 0, 3: 1, 0: 2}),
}


def _register(api: Api, job: Job) -> None:
    placement = {gpu: MEMORY for gpu in job.gpus.values()}
    for rank in job.order:
        body = rank_body(rank, world=job.world, gpu_index=job.gpus[rank], memory=MEMORY, placement=placement)
        api.register(**{**body, "process_id": job.names[rank]})


def _run(api: Api, job: Job, kind: str, addressed: int, ranks: dict[int, int] | None) -> dict[int, str]:
    """Asks for a job operation through rank ``addressed``'s process and carries it out as each
    rank's process would, checking that each one was handed its own rank's command; returns each
    rank's GPU afterwards."""
    request = None if ranks is None else {str(rank): f"cuda:{gpu}" for rank, gpu in ranks.items()}
    created = api.command(kind, job.names[addressed], ranks=request)
    assert created.status_code == 201, created.text
    wanted = {str(rank): f"GPU-{gpu:04d}" for rank, gpu in (ranks or {}).items()}
    (job_row,) = api.get("/jobs").json()
    before = {p["job"]["rank"]: p["gpu_uuid"] for p in job_row["ranks"]}
    moves = {rank: uuid for rank, uuid in wanted.items() if uuid != before[int(rank)]}
    operation = api.get(f"/operations/{created.json()['job']['operation_id']}").json()
    paired = {c["process_id"]: (c["job"]["rank"], c["target_uuid"]) for c in operation["commands"]}
    assert paired == {job.names[r]: (r, moves.get(str(r))) for r in range(job.world)}, paired
    after: dict[int, str] = {}
    for rank in job.order:  # each process polls in turn, in registration order
        process_id = job.names[rank]
        delivered = api.get(f"/processes/{process_id}/commands/next", params={"wait": 0}).json()
        assert delivered["kind"] == kind and delivered["process_id"] == process_id, delivered
        assert delivered["job"]["rank"] == rank, f"{process_id} (rank {rank}) was handed rank {delivered['job']}"
        assert delivered["job"]["moves"] == moves and delivered["target_uuid"] == moves.get(str(rank)), delivered
        after[rank] = delivered["target_uuid"] or before[rank]
        state = "PAUSED" if kind == "pause" else "RUNNING"
        update = {"state": state, "gpu_uuid": after[rank]}
        reported = api.post(f"/commands/{delivered['id']}/report", {"state": "succeeded", "process": update})
        assert reported.status_code == 200, reported.text
    assert api.get(f"/operations/{operation['id']}").json()["state"] == "succeeded"
    return after


@pytest.mark.parametrize("case", MOVES)
def test_every_command_of_a_job_operation_goes_to_the_rank_it_names(api: Api, case: str) -> None:
    job, resume_ranks, swap = MOVES[case]
    _register(api, job)
    started = {rank: f"GPU-{gpu:04d}" for rank, gpu in job.gpus.items()}
    last = job.order[-1]
    assert _run(api, job, "pause", addressed=last, ranks=None) == started
    resumed = _run(api, job, "resume", addressed=job.order[0], ranks=resume_ranks)
    assert resumed == {**started, **{rank: f"GPU-{gpu:04d}" for rank, gpu in resume_ranks.items()}}
    swapped = _run(api, job, "migrate", addressed=last, ranks=swap)
    assert swapped == {**resumed, **{rank: f"GPU-{gpu:04d}" for rank, gpu in swap.items()}}
    (listed,) = api.get("/jobs").json()
    shown: dict[str, Any] = {p["process_id"]: (p["job"]["rank"], p["gpu_uuid"]) for p in listed["ranks"]}
    assert shown == {job.names[rank]: (rank, uuid) for rank, uuid in swapped.items()}
