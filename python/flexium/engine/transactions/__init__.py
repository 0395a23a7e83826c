"""The transactions the engine runs, one module each, all over one OperationContext (context.py).

Every transaction ends with the process RUNNING on its source GPU, RUNNING on its target, or
(pause, failed resume) checkpointed and paused, and says so in its result; anything else sets
FAILED, which the engine raises as RollbackFailedError. The driver path (driver_migrate.py,
driver_pause.py) lets the checkpoint carry everything; the fast path (fast_migrate.py,
fast_pause.py) moves the memory pool's segments itself at a safe point and leaves the driver
only the rest; resume.py ends either kind of pause. What they share: locked_section.py (the
native locked section and the preparation before it), results.py (building and settling the
result), own_memory.py (imported memory made the job's own).
"""
