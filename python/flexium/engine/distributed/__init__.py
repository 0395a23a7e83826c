"""Jobs of several processes (torchrun, torch.distributed): which job and rank this process is
(membership), its NCCL communicators (nccl), how its ranks meet (rendezvous), the protocol
that pauses, resumes and migrates them together (job_operation) and this rank's part in it from
the command on (rank_part, which Engine.run_job_operation enters). docs/design.md, "Distributed
jobs", says how the parts fit."""
