"""What keeps the driver from touching a process it must not: memory its checkpoint cannot carry
refuses an operation before anything is touched (uncheckpointable_memory, with the CUDA memory
imported from another process that imported_memory finds), and the gate the locked section
closes holds the DataLoader's pin-memory thread while the process is locked or checkpointed
(pinning_gate)."""
