// Giving GPU memory back to the job when it runs out: the copier process (host_copier.h) may
// hold a context on the job's GPU while it keeps the host staging pinned ahead of a pause, and
// the job's own allocations come first. When an allocation of the pool fails for lack of memory,
// the allocator kills the registered process (its staged bytes live in the job's memfds, so
// nothing is lost), waits until it is gone and tries once more.
#pragma once

#include <cstddef>

namespace flexium {

// The process to kill for memory (0: none). Replaces the one registered before.
void set_gpu_memory_yielder(int pid);
int gpu_memory_yielder();

// Kills the registered process (once) and waits up to `wait_ms` until it has exited; true if
// there was one to kill. Safe from any thread, no GIL needed.
bool yield_gpu_memory(int wait_ms = 10000);

// How many times the job's allocations made a process give its GPU memory back.
std::size_t gpu_memory_yields();

}  // namespace flexium
