"""The fast path: PyTorch's CUDA memory on the job's GPU in a pool of flexium's own allocations
(memory_pool), whose segments the engine moves itself at a safe point (path: `FastPath`) to
another GPU or to host staging, so that the driver's checkpoint carries only the rest. A pause's
copies to and from host memory run in a copier process (host_copier, host_copier_process); the
staging is kept ready between pauses (kept_staging) within the machine's pinned host memory
budget (pinned_budget). docs/fast-path.md is the fast path in depth."""
