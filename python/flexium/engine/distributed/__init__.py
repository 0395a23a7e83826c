"""Jobs of several processes (torchrun, torch.distributed): which job and rank this process is
(membership), its NCCL communicators (nccl), how its ranks meet (rendezvous) and the protocol
that pauses, resumes and migrates them together (job_operation). docs/design.md, "Distributed
jobs", says how the parts fit."""
