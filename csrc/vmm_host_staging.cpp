// Vendor rules relied on, with evidence:
//  - copies between device memory and pinned host memory run at 55 GB/s here against 1.5 GB/s
//    from pageable memory (DESIGN.md fact 10), hence a pinned pool rather than plain buffers.
//  - CU_MEMHOSTALLOC_PORTABLE makes the pool pinned for every context, so segments of any
//    device can be staged through it and restored onto another.
//  - a segment's address range stays reserved across the checkpoint and a new allocation can be
//    mapped there after the restore (fact 9 maps the imported fd at the same address).
#include "vmm_host_staging.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "driver_error.h"
#include "vmm_driver.h"
#include "vmm_registry.h"

namespace flexium {
namespace {

struct Chunk {
  void *host = nullptr;
  std::size_t size = 0;
};

struct Piece {
  std::size_t chunk = 0;
  std::size_t offset = 0;  // in the chunk; the segment's own offset is the sum of earlier pieces
  std::size_t length = 0;
};

struct Stashed {
  std::uint64_t serial = 0;
  CUdeviceptr address = 0;
  std::size_t size = 0;
  int device = 0;
  std::vector<Piece> pieces;
};

// Both touched only under the registry lock.
struct Pool {
  int device = 0;  // whose context allocated the chunks (any context may free PORTABLE memory)
  std::vector<Chunk> chunks;
} pool;
std::vector<Stashed> stash;

std::size_t pool_bytes() {
  std::size_t total = 0;
  for (const Chunk &chunk : pool.chunks) total += chunk.size;
  return total;
}

void grow_pool(const DriverTable &d, std::size_t needed, std::size_t chunk_bytes, int device) {
  if (pool.chunks.empty()) pool.device = device;
  const std::size_t have = pool_bytes();
  if (have >= needed) return;
  ScopedContext context(d, pool.device);
  for (std::size_t missing = needed - have; missing > 0;) {
    const std::size_t size = std::min(chunk_bytes, missing);
    Chunk chunk;
    FLEXIUM_CU_CALL(d, cuMemHostAlloc, &chunk.host, size, CU_MEMHOSTALLOC_PORTABLE);
    chunk.size = size;
    pool.chunks.push_back(chunk);
    missing -= size;
  }
}

// Lays the segments out one after the other over the chunks, no piece longer than chunk_bytes.
std::vector<Stashed> plan(const SegmentMap &segments, std::size_t chunk_bytes) {
  std::vector<Stashed> planned;
  std::size_t chunk = 0, offset = 0;
  for (const auto &entry : segments) {
    const Segment &segment = entry.second;
    Stashed stashed{segment.serial, segment.address, segment.size, segment.device, {}};
    for (std::size_t remaining = segment.size; remaining > 0;) {
      if (offset == pool.chunks.at(chunk).size) {
        ++chunk, offset = 0;
        continue;
      }
      const std::size_t length = std::min({remaining, pool.chunks[chunk].size - offset, chunk_bytes});
      stashed.pieces.push_back({chunk, offset, length});
      offset += length;
      remaining -= length;
    }
    planned.push_back(std::move(stashed));
  }
  return planned;
}

char *host_of(const Piece &piece) { return static_cast<char *>(pool.chunks[piece.chunk].host) + piece.offset; }

// Erases the stash entries marked done, also when a restore stops half way.
struct EraseDone {
  std::vector<char> done;
  explicit EraseDone(std::size_t n) : done(n, 0) {}
  ~EraseDone() {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < stash.size(); ++i) {
      if (done[i]) continue;
      if (kept != i) stash[kept] = std::move(stash[i]);  // a self-move would empty its pieces
      ++kept;
    }
    stash.resize(kept);
  }
};

}  // namespace

std::size_t reserve_host_staging(std::size_t bytes, int device, std::size_t chunk_bytes) {
  if (chunk_bytes == 0) throw std::invalid_argument("chunk_bytes must be positive");
  const DriverTable &d = require_vmm_driver();
  std::size_t have = 0;
  {
    RegistryLock lock(kRelocationLockTimeout);
    have = pool_bytes();
    if (!pool.chunks.empty()) device = pool.device;
  }
  if (have >= bytes) return 0;
  // Pinned outside the registry lock: pinning gigabytes takes seconds, and the job's
  // allocations (which take that lock) must not wait for it.
  std::vector<Chunk> fresh;
  try {
    ScopedContext context(d, device);
    for (std::size_t missing = bytes - have; missing > 0;) {
      Chunk chunk;
      chunk.size = std::min(chunk_bytes, missing);
      FLEXIUM_CU_CALL(d, cuMemHostAlloc, &chunk.host, chunk.size, CU_MEMHOSTALLOC_PORTABLE);
      fresh.push_back(chunk);
      missing -= chunk.size;
    }
  } catch (...) {
    for (const Chunk &chunk : fresh) d.cuMemFreeHost(chunk.host);
    throw;
  }
  std::size_t added = 0;
  RegistryLock lock(kRelocationLockTimeout);
  if (pool.chunks.empty()) pool.device = device;
  for (const Chunk &chunk : fresh) {
    pool.chunks.push_back(chunk);
    added += chunk.size;
  }
  return added;
}

std::size_t stage_segments_to_host(std::size_t chunk_bytes) {
  if (chunk_bytes == 0) throw std::invalid_argument("chunk_bytes must be positive");
  const DriverTable &d = require_vmm_driver();
  RegistryLock lock(kRelocationLockTimeout);
  if (!stash.empty()) {
    throw std::runtime_error(std::to_string(stash.size()) +
                             " segments are still staged on the host: restore them first");
  }
  const SegmentMap &segments = lock.segments();
  if (segments.empty()) return 0;
  std::size_t total = 0;
  for (const auto &entry : segments) {
    if (!entry.second.mapped || !entry.second.has_handle) {
      throw std::invalid_argument(describe(entry.second) + " has no backing to stage");
    }
    total += entry.second.size;
  }
  grow_pool(d, total, chunk_bytes, segments.begin()->second.device);
  std::vector<Stashed> planned = plan(segments, chunk_bytes);
  std::map<int, std::vector<const Stashed *>> groups;
  for (const Stashed &stashed : planned) groups[stashed.device].push_back(&stashed);
  for (const auto &group : groups) {
    ScopedContext context(d, group.first);
    FLEXIUM_CU_CALL(d, cuCtxSynchronize);  // the copies must see every write already queued
    ScopedStream stream(d);
    for (const Stashed *stashed : group.second) {
      std::size_t done = 0;
      for (const Piece &piece : stashed->pieces) {
        FLEXIUM_CU_CALL(d, cuMemcpyDtoHAsync, host_of(piece), stashed->address + done, piece.length, stream.get());
        done += piece.length;
      }
    }
    stream.synchronize();
  }
  stash = std::move(planned);
  return total;
}

std::size_t restore_segments_from_host(int device) {
  const DriverTable &d = require_vmm_driver();
  RegistryLock lock(kRelocationLockTimeout);
  SegmentMap &segments = lock.segments();
  EraseDone erase(stash.size());
  std::map<int, std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < stash.size(); ++i) {
    auto found = segments.find(stash[i].address);
    const bool waiting = found != segments.end() && found->second.serial == stash[i].serial && !found->second.mapped;
    if (!waiting) {
      erase.done[i] = 1;  // freed meanwhile, or never released: nothing to bring back
      continue;
    }
    groups[device >= 0 ? device : stash[i].device].push_back(i);
  }
  std::size_t restored = 0;
  for (const auto &group : groups) {
    const int target = group.first;
    ScopedContext context(d, target);
    // Declared before the stream: on failure the stream waits for its copies, then these unwind.
    std::vector<std::unique_ptr<Backing>> made;
    ScopedStream stream(d);
    const CUmemAllocationProp prop = device_allocation_prop(target);
    for (const std::size_t i : group.second) {
      const Stashed &stashed = stash[i];
      made.push_back(std::make_unique<Backing>(d));
      Backing &backing = *made.back();
      backing.address = stashed.address;
      backing.size = stashed.size;
      FLEXIUM_CU_CALL(d, cuMemCreate, &backing.handle, stashed.size, &prop, 0);
      backing.created = true;
      FLEXIUM_CU_CALL(d, cuMemMap, stashed.address, stashed.size, 0, backing.handle, 0);
      backing.mapped = true;
      grant_access(d, stashed.address, stashed.size, {target});
      std::size_t done = 0;
      for (const Piece &piece : stashed.pieces) {
        FLEXIUM_CU_CALL(d, cuMemcpyHtoDAsync, stashed.address + done, host_of(piece), piece.length, stream.get());
        done += piece.length;
      }
    }
    stream.synchronize();
    for (std::size_t k = 0; k < group.second.size(); ++k) {
      const std::size_t i = group.second[k];
      Segment &segment = segments.at(stash[i].address);
      if (segment.has_handle) d.cuMemRelease(segment.handle);  // left by a half-failed release
      segment.handle = made[k]->handle;
      segment.has_handle = segment.mapped = true;
      segment.device = target;
      made[k]->release_to_caller();
      erase.done[i] = 1;
      restored += stash[i].size;
    }
  }
  return restored;
}

void release_host_staging() {
  RegistryLock lock(kRelocationLockTimeout);
  if (!stash.empty()) {
    throw std::runtime_error(std::to_string(stash.size()) +
                             " segments are still staged on the host: restore them first");
  }
  if (pool.chunks.empty()) return;
  const DriverTable &d = require_vmm_driver();
  ScopedContext context(d, pool.device);
  while (!pool.chunks.empty()) {
    FLEXIUM_CU_CALL(d, cuMemFreeHost, pool.chunks.back().host);
    pool.chunks.pop_back();
  }
}

std::size_t host_staging_pool_bytes() {
  RegistryLock lock(kRelocationLockTimeout);
  return pool_bytes();
}

std::size_t host_staged_segments() {
  RegistryLock lock(kRelocationLockTimeout);
  return stash.size();
}

}  // namespace flexium
