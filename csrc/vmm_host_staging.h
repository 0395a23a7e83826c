// Pause and resume of the allocator's segments through pinned host memory: the host side of
// the fast path (DESIGN.md "Fast path": "Pause is the same with pinned host memory"). Same rules
// as vmm_relocate.h: process RUNNING, registry lock held for the run, DriverError naming the call.
#pragma once

#include <cstddef>

namespace flexium {

constexpr std::size_t kDefaultHostChunkBytes = std::size_t{256} << 20;

// Grows the pinned pool to at least `bytes` ahead of a pause, with `device`'s context (the pool's
// own once it has chunks), without holding the registry lock while pinning. Returns bytes added.
std::size_t reserve_host_staging(std::size_t bytes, int device, std::size_t chunk_bytes = kDefaultHostChunkBytes);

// Copies every segment into a pinned staging pool, in pieces of at most `chunk_bytes` (the pool
// grows by chunks of that size and is kept for the next pause). Segments stay as they are: call
// release_source_backing() next. Returns the bytes staged. Throws std::runtime_error while the
// pool still holds segments not restored; on a driver failure nothing is staged.
std::size_t stage_segments_to_host(std::size_t chunk_bytes = kDefaultHostChunkBytes);

// Gives each staged segment new memory on `device` (-1: the device it had), mapped at its own
// address, and copies its bytes back. Segments freed meanwhile are dropped; ones already mapped
// are skipped, so a failed restore can be retried (on another device too). Returns bytes restored.
std::size_t restore_segments_from_host(int device = -1);

// Frees the pinned pool. Throws std::runtime_error while it holds segments not restored.
void release_host_staging();

std::size_t host_staging_pool_bytes();  // pinned bytes held by the pool
std::size_t host_staged_segments();     // segments waiting in it

}  // namespace flexium
