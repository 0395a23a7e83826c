// The host staging's memory: memfd extents mapped here (and by the copier process), touched
// ahead of a pause, pinned chunk by chunk, given back after a resume.
//
// Vendor rules relied on:
//  - copies from pinned host memory are far faster than from pageable memory: the staging is pinned
//    (fact `copy-ceilings`).
//  - pinned memory in the process slows its checkpoint and restore, unpinned it costs nothing: pinned only while
//    copies run (fact `pinned-memory-slows-checkpoint`).
//  - registering touched memory pins far faster than cuMemHostAlloc, about the copy speed: the staging is touched
//    ahead of the pause and registered (fact `pinning-holds-job-calls`).
//  - a memfd mapped shared lets the copier process (host_copier.h) pin the same pages; pinned there, they cost
//    this process's checkpoint nothing (facts `staging-pinned-by-copier` and `pinning-does-not-scale`).
//  - CU_MEMHOSTREGISTER_PORTABLE makes a registration count for every context, so a chunk pinned
//    with one GPU's context serves a restore onto another.
#include "vmm_host_staging.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>

#include "driver_error.h"
#include "vmm_host_staging_state.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels say EINVAL and the pages are touched instead
#endif

namespace flexium {
namespace host_staging {
namespace {

constexpr std::size_t kPageBytes = 4096;
constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;
// Beside training the touching leaves half the cores to the job; with the job stopped at its safe
// point (a pause that makes its staging there) it may take them all: 16 files and threads touched a
// 64 GiB staging 30% faster than 8 (fact `streamed-staging-pace`).
constexpr std::size_t kTouchThreadsBesideTraining = 8;
constexpr std::size_t kTouchThreadsJobStopped = 16;
constexpr std::chrono::milliseconds kPinBreak{2};
constexpr std::chrono::milliseconds kUnmapBreak{1};
std::atomic<bool> release_hurried{false};

// An extent of a staging given back: unmapped (`drop_first`: its pages dropped first, which runs beside
// other threads where munmap would not) and its fd closed; the copier's mapping (or fd), if any, keeps
// the memory until it lets go.
void let_go(const Extent &extent, bool drop_first) noexcept {
  if (!extent.driver_made) {
    if (drop_first) ::madvise(extent.base, extent.size, MADV_DONTNEED);
    ::munmap(extent.base, extent.size);
  }
  ::close(extent.fd);
}

void touch(char *base, std::size_t size) {
  if (::madvise(base, size, MADV_POPULATE_WRITE) == 0) return;
  // Without MADV_POPULATE_WRITE (Linux < 5.14): each page written with what it holds, as the copier touches written
  // pages too (nothing else writes the staging meanwhile).
  volatile char *bytes = base;
  for (std::size_t offset = 0; offset < size; offset += kPageBytes) bytes[offset] = bytes[offset];
}

std::size_t touch_threads(std::size_t size, bool job_stopped) {
  const std::size_t cores = std::max(1u, std::thread::hardware_concurrency());
  const std::size_t most =
      job_stopped ? std::min(kTouchThreadsJobStopped, cores) : std::min(kTouchThreadsBesideTraining, cores / 2);
  return std::max<std::size_t>(1, std::min(most, size / (64 * kHugePageBytes)));
}

// One memfd of `size` bytes mapped shared on a huge-page boundary (where the kernel can use huge
// pages), not touched yet.
Extent map_file(std::size_t size) {
  const int fd = ::memfd_create("flexium-host-staging", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int error = errno;
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("could not create " + std::to_string(size) +
                             " bytes of host memory for the staging: " + std::strerror(error));
  }
  const std::size_t span = size + kHugePageBytes;
  void *raw = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  char *start = raw == MAP_FAILED
                    ? nullptr
                    : reinterpret_cast<char *>(round_up(reinterpret_cast<std::uintptr_t>(raw), kHugePageBytes));
  if (start == nullptr || ::mmap(start, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
    const int error = errno;
    if (raw != MAP_FAILED) ::munmap(raw, span);
    ::close(fd);
    throw std::runtime_error("could not map " + std::to_string(size) +
                             " bytes of host memory for the staging: " + std::strerror(error));
  }
  const std::size_t head = static_cast<std::size_t>(start - static_cast<char *>(raw));
  if (head > 0) ::munmap(raw, head);
  if (span - head > size) ::munmap(start + size, span - head - size);
  // Hints: huge pages make touching and pinning faster; forked children (DataLoader workers)
  // neither need the staging nor should share its pages while the GPU writes them.
  ::madvise(start, size, MADV_HUGEPAGE);
  ::madvise(start, size, MADV_DONTFORK);
  Extent file;
  file.fd = fd;
  file.base = start;
  file.size = size;
  return file;
}

void unmap_files(const std::vector<Extent> &files) noexcept {
  for (const Extent &file : files) {
    ::munmap(file.base, file.size);
    ::close(file.fd);
  }
}

}  // namespace

Staging staging;

void check_chunk_bytes(std::size_t chunk_bytes) {
  if (chunk_bytes == 0 || chunk_bytes % kPageBytes != 0) {
    throw std::invalid_argument("chunk_bytes must be a positive multiple of " + std::to_string(kPageBytes) + ", got " +
                                std::to_string(chunk_bytes));
  }
}

std::size_t mapped_bytes() {
  std::size_t total = 0;
  for (const Chunk &chunk : staging.chunks) total += chunk.size;
  return total;
}

std::size_t waiting_segments() {
  return static_cast<std::size_t>(
      std::count_if(staging.stashed.begin(), staging.stashed.end(), [](const Stashed &s) { return !s.done; }));
}

void refuse_while_staged(const char *what) {
  const std::size_t waiting = waiting_segments();
  if (waiting > 0) {
    throw std::runtime_error(std::string(what) + ": " + std::to_string(waiting) +
                             " segments are still staged on the host: restore them first");
  }
}

void map_extent(std::size_t bytes, std::size_t chunk_bytes, bool touch_here, bool job_stopped) {
  const std::size_t total = round_up(bytes, kHugePageBytes);
  const std::size_t files = touch_threads(total, job_stopped);
  const std::size_t each = round_up((total + files - 1) / files, kHugePageBytes);
  std::vector<Extent> made;
  try {
    for (std::size_t offset = 0; offset < total; offset += each)
      made.push_back(map_file(std::min(each, total - offset)));
  } catch (...) {
    unmap_files(made);
    throw;
  }
  if (touch_here) {
    std::vector<std::pair<char *, std::size_t>> ranges;
    for (const Extent &file : made) ranges.emplace_back(file.base, file.size);
    populate_host_pages(ranges);
  }
  const std::size_t first = staging.extents.size();
  staging.extents.insert(staging.extents.end(), made.begin(), made.end());
  // Chunks taken in turn from each file: the copies fill the chunks in this order, so that a copier
  // touching each file in a thread of its own, from its start, has the next chunk ready soonest.
  for (std::size_t offset = 0; offset < made.front().size; offset += chunk_bytes) {
    for (std::size_t k = 0; k < made.size(); ++k) {
      const Extent &file = made[k];
      if (offset >= file.size) continue;
      staging.chunks.push_back(
          {file.base + offset, std::min(chunk_bytes, file.size - offset), false, first + k, offset});
    }
  }
}

bool driver_made(const Chunk &chunk) { return staging.extents[chunk.extent].driver_made; }

void pin(const DriverTable &d, Chunk &chunk) {
  if (chunk.pinned) return;
  Extent &extent = staging.extents[chunk.extent];
  if (extent.driver_made) {
    CUdevice device = 0;
    FLEXIUM_CU_CALL(d, cuCtxGetDevice, &device);
    extent.mapped_here = map_exported(d, extent.fd, extent.size, device);
    extent.base = reinterpret_cast<char *>(static_cast<std::uintptr_t>(extent.mapped_here->address));
    chunk.host = extent.base + chunk.offset;
  } else {
    FLEXIUM_CU_CALL(d, cuMemHostRegister, chunk.host, chunk.size, CU_MEMHOSTREGISTER_PORTABLE);
  }
  chunk.pinned = true;
}

void unpin(const DriverTable &d, Chunk &chunk) {
  if (!chunk.pinned) return;
  Extent &extent = staging.extents[chunk.extent];
  if (extent.driver_made) {
    extent.mapped_here.reset();
    extent.base = chunk.host = nullptr;
  } else {
    FLEXIUM_CU_CALL(d, cuMemHostUnregister, chunk.host);
  }
  chunk.pinned = false;
}

// After a failure: nothing pinned may ride into the next checkpoint. Best effort.
void unpin_all_quietly(const DriverTable &d, int device) noexcept {
  try {
    if (std::none_of(staging.chunks.begin(), staging.chunks.end(), [](const Chunk &c) { return c.pinned; })) return;
    ScopedContext context(d, device);
    for (Chunk &chunk : staging.chunks) {
      if (chunk.pinned && driver_made(chunk)) {
        unpin(d, chunk);  // never throws for driver-made memory: the Backing unmaps it
      } else if (chunk.pinned && d.cuMemHostUnregister(chunk.host) == CUDA_SUCCESS) {
        chunk.pinned = false;
      }
    }
  } catch (...) {
  }
}

}  // namespace host_staging

using namespace host_staging;

void each_in_a_thread(std::size_t count, const std::function<void(std::size_t)> &work) {
  if (count == 0) return;
  std::vector<std::thread> workers;
  try {
    for (std::size_t i = 1; i < count; ++i) workers.emplace_back(work, i);
  } catch (const std::system_error &) {
    // No more threads to be had: this one runs the work not handed out.
  }
  work(0);
  for (std::size_t i = workers.size() + 1; i < count; ++i) work(i);
  for (std::thread &worker : workers) worker.join();
}

// One thread per range (memfd): the kernel zeroes new pages at memory speed per thread, and threads
// faulting one shared file wait on each other (one file from 8 threads: 4.3 GB/s to touch; 8 files:
// 11 GB/s, fact `staging-kept-pinned-ahead`).
void populate_host_pages(const std::vector<std::pair<char *, std::size_t>> &ranges) {
  each_in_a_thread(ranges.size(), [&ranges](std::size_t i) { touch(ranges[i].first, ranges[i].second); });
}

std::size_t reserve_host_staging(std::size_t bytes, int device, std::size_t chunk_bytes, bool pin_here,
                                 bool job_stopped) {
  check_chunk_bytes(chunk_bytes);
  const DriverTable &d = require_vmm_driver();
  std::lock_guard<std::mutex> guard(staging.mutex);
  refuse_while_staged("cannot reserve host staging");
  const std::size_t have = mapped_bytes();
  if (have < bytes) map_extent(bytes - have, chunk_bytes, pin_here, job_stopped);
  if (!pin_here) return 0;
  std::size_t pinned = 0;
  try {
    ScopedContext context(d, device);
    // Only as many chunks as `bytes` needs: the layout fills them from the first.
    for (std::size_t i = 0, covered = 0; i < staging.chunks.size() && covered < bytes; ++i) {
      Chunk &chunk = staging.chunks[i];
      covered += chunk.size;
      // Driver-made memory is pinned by nature; mapped here ahead, it would ride the job's checkpoint, which
      // cannot restore it (fact `cumem-host-memory-unrestorable`): the copies here map it while they run.
      if (chunk.pinned || driver_made(chunk)) continue;
      // A break between chunks lets the job's CUDA calls through while we pin (fact `pinning-holds-job-calls`).
      if (pinned > 0) std::this_thread::sleep_for(kPinBreak);
      pin(d, chunk);
      pinned += chunk.size;
    }
  } catch (...) {
    unpin_all_quietly(d, device);
    throw;
  }
  staging.device = device;
  return pinned;
}

std::size_t adopt_host_memory(const std::vector<std::pair<int, std::size_t>> &allocations) {
  std::vector<OwnedFd> owned;
  for (const auto &allocation : allocations) owned.emplace_back(allocation.first);
  std::lock_guard<std::mutex> guard(staging.mutex);
  refuse_while_staged("cannot add host memory to the staging");
  for (std::size_t i = 0; i < allocations.size(); ++i) {
    const std::size_t size = allocations[i].second;
    if (size == 0 || size % kPageBytes != 0) {
      throw std::invalid_argument("host memory of " + std::to_string(size) + " bytes: not whole pages");
    }
  }
  for (std::size_t i = 0; i < allocations.size(); ++i) {
    Extent extent;
    extent.fd = owned[i].release();
    extent.size = allocations[i].second;
    extent.driver_made = true;
    staging.extents.push_back(extent);
    staging.chunks.push_back({nullptr, extent.size, false, staging.extents.size() - 1, 0});
  }
  return mapped_bytes();
}

HostStagingLayout host_staging_layout() {
  std::lock_guard<std::mutex> guard(staging.mutex);
  HostStagingLayout layout;
  for (const Extent &extent : staging.extents) {
    layout.extents.emplace_back(extent.fd, extent.size);
    layout.driver_made.push_back(extent.driver_made);
  }
  for (const Chunk &chunk : staging.chunks) layout.chunks.push_back({chunk.extent, chunk.offset, chunk.size});
  return layout;
}

void set_host_release_hurried(bool hurried) { release_hurried = hurried; }

std::size_t release_host_staging(bool keep_driver_made) {
  std::lock_guard<std::mutex> guard(staging.mutex);
  refuse_while_staged("cannot release host staging");
  staging.stashed.clear();
  staging.pieces.clear();
  if (std::any_of(staging.chunks.begin(), staging.chunks.end(), [](const Chunk &c) { return c.pinned; })) {
    const DriverTable &d = require_vmm_driver();
    ScopedContext context(d, staging.device);
    for (Chunk &chunk : staging.chunks) unpin(d, chunk);
  }
  // munmap takes the mmap lock for writing, which the job's page faults wait for. Dropped chunk by chunk
  // (MADV_DONTNEED takes the lock for reading only), so munmap finds nothing left to hold the job up
  // (fact `staging-unmapped-in-chunks`). Hurried, the rest goes a file per thread, whose close frees the
  // file's pages (the copier let go of them first), the slowest part (fact `staging-given-back`).
  std::size_t dropped = 0;
  for (; dropped < staging.chunks.size() && !release_hurried; ++dropped) {
    const Chunk &chunk = staging.chunks[dropped];
    if (driver_made(chunk)) continue;  // not mapped here: its fd holds it
    if (dropped > 0) std::this_thread::sleep_for(kUnmapBreak);
    ::madvise(chunk.host, chunk.size, MADV_DONTNEED);
  }
  std::size_t released = 0;
  std::vector<Extent> kept;
  std::vector<Extent> going;
  std::vector<std::size_t> kept_as(staging.extents.size(), SIZE_MAX);
  for (std::size_t k = 0; k < staging.extents.size(); ++k) {
    const Extent &extent = staging.extents[k];
    if (keep_driver_made && extent.driver_made) {
      kept_as[k] = kept.size();
      kept.push_back(extent);
      continue;
    }
    going.push_back(extent);
    released += extent.size;
  }
  std::size_t closed = 0;
  for (; closed < going.size() && !release_hurried; ++closed) let_go(going[closed], false);
  each_in_a_thread(going.size() - closed, [&going, closed](std::size_t k) { let_go(going[closed + k], true); });
  std::vector<Chunk> kept_chunks;
  for (Chunk chunk : staging.chunks) {
    if (kept_as[chunk.extent] == SIZE_MAX) continue;
    chunk.extent = kept_as[chunk.extent];
    kept_chunks.push_back(chunk);
  }
  staging.extents = std::move(kept);
  staging.chunks = std::move(kept_chunks);
  return released;
}

std::size_t host_staging_pool_bytes() {
  std::lock_guard<std::mutex> guard(staging.mutex);
  return mapped_bytes();
}

std::size_t host_staging_pinned_bytes() {
  std::lock_guard<std::mutex> guard(staging.mutex);
  std::size_t pinned = 0;
  for (const Chunk &chunk : staging.chunks) pinned += chunk.pinned ? chunk.size : 0;
  return pinned;
}

std::size_t host_staged_segments() {
  std::lock_guard<std::mutex> guard(staging.mutex);
  return waiting_segments();
}

}  // namespace flexium
