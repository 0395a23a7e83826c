// Vendor rules relied on, with evidence:
//  - copies between device memory and pinned host memory run at 55 GB/s here against 1.5 GB/s
//    from pageable memory (DESIGN.md fact 10), hence pinned staging.
//  - pinned host memory in the process slows the driver's checkpoint and, more, its restore
//    (H200, driver 580, 16 GiB pinned: checkpoint + restore +0.68 s with cuMemHostRegister,
//    +0.70 s with cuMemHostAlloc); the same memory unregistered before the checkpoint costs
//    +0.03 s (bench/staging_probe.py checkpoint_pinned). Registering touched memory runs at
//    46 GB/s and unregistering at 53 GB/s, about the copy speed, while cuMemHostAlloc pins at
//    2.5 GB/s. So the staging is host memory touched ahead of the pause and pinned chunk by chunk
//    only while copies run through it.
//  - the staging is a memfd mapped shared, so that the copier process (host_copier.h) can map
//    and pin the same pages: pinned there, they cost this process's checkpoint nothing. Without
//    shmem huge pages (shmem_enabled "never", the H200 hosts) it pins at 27 GB/s against 57 GB/s
//    for anonymous memory (staging_probe.py shared_staging), still ahead of the safe point.
//  - CU_MEMHOSTREGISTER_PORTABLE makes a registration count for every context, so a chunk pinned
//    with one GPU's context serves a restore onto another.
//  - a segment's address range stays reserved across the checkpoint and a new allocation can be
//    mapped there after the restore (fact 9 maps the imported fd at the same address).
#include "vmm_host_staging.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "driver_error.h"
#include "vmm_driver.h"
#include "vmm_registry.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels say EINVAL and the pages are touched instead
#endif

namespace flexium {
namespace {

constexpr std::size_t kPageBytes = 4096;
constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;
constexpr std::size_t kMaxTouchThreads = 8;
constexpr std::chrono::milliseconds kPinBreak{2};
constexpr std::chrono::milliseconds kUnmapBreak{1};

// One memfd, mapped shared here and by the copier process.
struct Extent {
  int fd = -1;
  char *base = nullptr;
  std::size_t size = 0;
};

struct Chunk {
  char *host = nullptr;
  std::size_t size = 0;
  bool pinned = false;
  std::size_t extent = 0;  // index in Staging::extents
  std::size_t offset = 0;  // in that extent
};

struct Stashed {
  std::uint64_t serial = 0;
  CUdeviceptr address = 0;
  std::size_t size = 0;
  int device = 0;
  bool done = false;  // restored, or freed meanwhile
};

// One copy between a segment and the staging. Pieces are laid out in chunk order.
struct Piece {
  std::size_t stashed = 0;  // index in Staging::stashed
  std::size_t offset = 0;   // in the segment
  std::size_t chunk = 0;
  std::size_t chunk_offset = 0;
  std::size_t length = 0;
};

// Guarded by `mutex`, taken after the registry lock where a call needs both and never by the
// allocator: pinning gigabytes ahead of a pause must not hold up the job's allocations.
struct Staging {
  std::mutex mutex;
  int device = 0;  // whose context pinned chunks last (PORTABLE: any context may unpin them)
  std::vector<Extent> extents;
  std::vector<Chunk> chunks;
  std::vector<Stashed> stashed;
  std::vector<Piece> pieces;
} staging;

struct Layout {
  std::vector<Stashed> stashed;
  std::vector<Piece> pieces;
  std::size_t bytes = 0;
};

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

// Faults the pages in from a few threads: the kernel zeroes them at memory speed per thread, and
// a single thread would take seconds for tens of GiB.
void touch(char *base, std::size_t size) {
  const std::size_t cores = std::max(1u, std::thread::hardware_concurrency());
  const std::size_t threads =
      std::max<std::size_t>(1, std::min({kMaxTouchThreads, cores / 2, size / (64 * kHugePageBytes)}));
  const std::size_t slice = round_up((size + threads - 1) / threads, kHugePageBytes);
  const auto work = [](char *from, std::size_t length) {
    if (::madvise(from, length, MADV_POPULATE_WRITE) == 0) return;
    for (std::size_t offset = 0; offset < length; offset += kPageBytes) static_cast<volatile char *>(from)[offset] = 0;
  };
  std::vector<std::thread> workers;
  std::size_t start = slice;
  try {
    for (; start < size; start += slice) workers.emplace_back(work, base + start, std::min(slice, size - start));
  } catch (const std::system_error &) {
    // No more threads to be had: this one touches what was not handed out.
  }
  work(base, std::min(slice, size));
  if (start < size) work(base + start, size - start);
  for (std::thread &worker : workers) worker.join();
}

// A new extent of at least `bytes`, touched, not pinned, cut into chunks of `chunk_bytes`
// (appended to the staging's chunks).
void map_extent(std::size_t bytes, std::size_t chunk_bytes) {
  const std::size_t size = round_up(bytes, kHugePageBytes);
  const int fd = ::memfd_create("flexium-host-staging", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int error = errno;
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("could not create " + std::to_string(size) +
                             " bytes of host memory for the staging: " + std::strerror(error));
  }
  // Placed on a huge-page boundary inside a larger reservation, where the kernel can use huge pages.
  const std::size_t span = size + kHugePageBytes;
  void *raw = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  char *start = raw == MAP_FAILED
                    ? nullptr
                    : reinterpret_cast<char *>(round_up(reinterpret_cast<std::uintptr_t>(raw), kHugePageBytes));
  if (start == nullptr ||
      ::mmap(start, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
    const int error = errno;
    if (raw != MAP_FAILED) ::munmap(raw, span);
    ::close(fd);
    throw std::runtime_error("could not map " + std::to_string(size) + " bytes of host memory for the staging: " +
                             std::strerror(error));
  }
  const std::size_t head = static_cast<std::size_t>(start - static_cast<char *>(raw));
  if (head > 0) ::munmap(raw, head);
  if (span - head > size) ::munmap(start + size, span - head - size);
  // Hints: huge pages make touching and pinning faster; forked children (DataLoader workers)
  // neither need the staging nor should share its pages while the GPU writes them.
  ::madvise(start, size, MADV_HUGEPAGE);
  ::madvise(start, size, MADV_DONTFORK);
  touch(start, size);
  const std::size_t extent = staging.extents.size();
  staging.extents.push_back({fd, start, size});
  for (std::size_t offset = 0; offset < size; offset += chunk_bytes) {
    staging.chunks.push_back({start + offset, std::min(chunk_bytes, size - offset), false, extent, offset});
  }
}

void pin(const DriverTable &d, Chunk &chunk) {
  if (chunk.pinned) return;
  FLEXIUM_CU_CALL(d, cuMemHostRegister, chunk.host, chunk.size, CU_MEMHOSTREGISTER_PORTABLE);
  chunk.pinned = true;
}

void unpin(const DriverTable &d, Chunk &chunk) {
  if (!chunk.pinned) return;
  FLEXIUM_CU_CALL(d, cuMemHostUnregister, chunk.host);
  chunk.pinned = false;
}

// After a failure: nothing pinned may ride into the next checkpoint. Best effort.
void unpin_all_quietly(const DriverTable &d, int device) noexcept {
  try {
    if (std::none_of(staging.chunks.begin(), staging.chunks.end(), [](const Chunk &c) { return c.pinned; })) return;
    ScopedContext context(d, device);
    for (Chunk &chunk : staging.chunks) {
      if (chunk.pinned && d.cuMemHostUnregister(chunk.host) == CUDA_SUCCESS) chunk.pinned = false;
    }
  } catch (...) {
  }
}

char *host_of(const Piece &piece) { return staging.chunks[piece.chunk].host + piece.chunk_offset; }

// Lays the live ranges of the segments out one after the other over the chunks, each device's
// group starting on a chunk of its own (a chunk is unpinned once all its copies are done), and
// maps more staging where the chunks run out (the pool grew after the reserve).
Layout plan(const std::map<int, std::vector<const Segment *>> &groups, const LiveRanges &live,
            std::size_t chunk_bytes, bool may_grow = true) {
  std::size_t total = 0;
  for (const auto &group : groups) {
    for (const Segment *segment : group.second) {
      for (const auto &range : live_ranges_of(*segment, live)) total += range.second;
    }
  }
  Layout layout;
  std::size_t chunk = 0, offset = 0;
  for (const auto &group : groups) {
    if (offset != 0) ++chunk, offset = 0;
    for (const Segment *segment : group.second) {
      const std::size_t index = layout.stashed.size();
      layout.stashed.push_back({segment->serial, segment->address, segment->size, segment->device, false});
      for (const auto &range : live_ranges_of(*segment, live)) {
        for (std::size_t done = 0; done < range.second;) {
          if (chunk == staging.chunks.size()) {
            if (!may_grow) {
              throw std::length_error("the pool's live bytes (" + std::to_string(total) +
                                      ") outgrew the host staging prepared for them (" +
                                      std::to_string(mapped_bytes()) + " bytes)");
            }
            map_extent(total - layout.bytes, chunk_bytes);
          }
          const Chunk &into = staging.chunks[chunk];
          if (offset == into.size) {
            ++chunk, offset = 0;
            continue;
          }
          const std::size_t length = std::min(range.second - done, into.size - offset);
          layout.pieces.push_back({index, range.first + done, chunk, offset, length});
          offset += length;
          done += length;
          layout.bytes += length;
        }
      }
    }
  }
  return layout;
}

// Events recorded after each chunk's last copy on a stream, waited for in order.
class ChunkEvents {
 public:
  explicit ChunkEvents(const DriverTable &d) : d_(d) {}
  ~ChunkEvents() {
    for (const auto &entry : events_) d_.cuEventDestroy(entry.second);
  }
  ChunkEvents(const ChunkEvents &) = delete;
  ChunkEvents &operator=(const ChunkEvents &) = delete;

  void record(std::size_t chunk, CUstream stream) {
    CUevent event = nullptr;
    FLEXIUM_CU_CALL(d_, cuEventCreate, &event, CU_EVENT_DISABLE_TIMING);
    events_.emplace_back(chunk, event);
    FLEXIUM_CU_CALL(d_, cuEventRecord, event, stream);
  }

  // done(chunk) for each chunk as soon as its copies have finished, in order.
  template <typename Done>
  void each_done(Done &&done) {
    for (const auto &entry : events_) {
      FLEXIUM_CU_CALL(d_, cuEventSynchronize, entry.second);
      done(entry.first);
    }
  }

 private:
  const DriverTable &d_;
  std::vector<std::pair<std::size_t, CUevent>> events_;
};

// Queues copy(piece) for the pieces of the segments marked in `member`, in chunk order:
// before(chunk) ahead of each chunk's first piece, an event after its last.
template <typename Copy, typename Before>
void queue_by_chunk(const std::vector<Piece> &pieces, const std::vector<char> &member, CUstream stream,
                    ChunkEvents &events, Copy &&copy, Before &&before) {
  bool open = false;
  std::size_t current = 0;
  for (const Piece &piece : pieces) {
    if (!member[piece.stashed]) continue;
    if (!open || piece.chunk != current) {
      if (open) events.record(current, stream);
      before(piece.chunk);
      current = piece.chunk;
      open = true;
    }
    copy(piece);
  }
  if (open) events.record(current, stream);
}

// The segments to stage, by device; every one must have its memory.
std::map<int, std::vector<const Segment *>> by_device_to_stage(const SegmentMap &segments) {
  std::map<int, std::vector<const Segment *>> groups;
  for (const auto &entry : segments) {
    if (!entry.second.mapped || !entry.second.has_handle) {
      throw std::invalid_argument(describe(entry.second) + " has no backing to stage");
    }
    groups[entry.second.device].push_back(&entry.second);
  }
  return groups;
}

// The staged segments that still wait for memory, by the device they go back to (`device`, or
// where each was when -1); the ones freed meanwhile or never released are marked done.
std::map<int, std::vector<std::size_t>> waiting_by_device(const SegmentMap &segments, int device) {
  std::map<int, std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < staging.stashed.size(); ++i) {
    Stashed &stashed = staging.stashed[i];
    if (stashed.done) continue;
    const auto found = segments.find(stashed.address);
    if (found == segments.end() || found->second.serial != stashed.serial || found->second.mapped) {
      stashed.done = true;  // freed meanwhile, or never released: nothing to bring back
      continue;
    }
    groups[device >= 0 ? device : stashed.device].push_back(i);
  }
  return groups;
}

// New memory on `target` mapped at each of the staged segments' addresses (the current context
// must be `target`'s). Undone on unwind unless adopted.
std::vector<std::unique_ptr<Backing>> make_backings(const DriverTable &d, int target,
                                                    const std::vector<std::size_t> &indices) {
  std::vector<std::unique_ptr<Backing>> made;
  const CUmemAllocationProp prop = device_allocation_prop(target);
  for (const std::size_t i : indices) {
    const Stashed &stashed = staging.stashed[i];
    made.push_back(std::make_unique<Backing>(d));
    Backing &backing = *made.back();
    backing.address = stashed.address;
    backing.size = stashed.size;
    FLEXIUM_CU_CALL(d, cuMemCreate, &backing.handle, stashed.size, &prop, 0);
    backing.created = true;
    FLEXIUM_CU_CALL(d, cuMemMap, stashed.address, stashed.size, 0, backing.handle, 0);
    backing.mapped = true;
    grant_access(d, stashed.address, stashed.size, {target});
  }
  return made;
}

// The segments own their new memory (their bytes are back): the registry says so.
void adopt_backings(const DriverTable &d, SegmentMap &segments, const std::vector<std::size_t> &indices,
                    std::vector<std::unique_ptr<Backing>> &made, int target) {
  for (std::size_t k = 0; k < indices.size(); ++k) {
    Stashed &stashed = staging.stashed[indices[k]];
    Segment &segment = segments.at(stashed.address);
    if (segment.has_handle) d.cuMemRelease(segment.handle);  // left by a half-failed release
    segment.handle = made[k]->handle;
    segment.has_handle = segment.mapped = true;
    segment.imported = false;
    segment.exportable = true;  // fresh memory of ours, whatever the driver left before
    segment.device = target;
    made[k]->release_to_caller();
    stashed.done = true;
  }
  if (waiting_segments() == 0) {
    staging.stashed.clear();
    staging.pieces.clear();
  }
}

// An order handed to the copier: its locks are held until it is finished or aborted, so no
// allocation or other move touches the segments while the copier copies them.
struct PendingOrder {
  std::unique_ptr<RegistryLock> lock;
  std::unique_lock<std::mutex> guard;
  bool restore = false;
  int device = 0;
  Layout layout;                                // stage: the layout to adopt
  std::vector<std::size_t> indices;             // restore: the stashed segments it brings back
  std::vector<std::unique_ptr<Backing>> made;   // restore: their new memory
  std::vector<OwnedFd> fds;                     // exported for the copier, closed at the end
  std::size_t bytes = 0;
};
std::unique_ptr<PendingOrder> pending;

void refuse_second_order() {
  if (pending) throw std::runtime_error("a copier order is already open: finish or abort it first");
}

// A new order holding the registry lock, then the staging's mutex (the order every call takes them in).
std::unique_ptr<PendingOrder> open_order() {
  refuse_second_order();  // before the locks: the open order holds them
  auto order = std::make_unique<PendingOrder>();
  order->lock = std::make_unique<RegistryLock>(kRelocationLockTimeout);
  order->guard = std::unique_lock<std::mutex>(staging.mutex);
  return order;
}

int export_fd(const DriverTable &d, CUmemGenericAllocationHandle handle) {
  int fd = -1;
  FLEXIUM_CU_CALL(d, cuMemExportToShareableHandle, &fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  return fd;
}

}  // namespace

std::size_t reserve_host_staging(std::size_t bytes, int device, std::size_t chunk_bytes, bool pin_here) {
  check_chunk_bytes(chunk_bytes);
  const DriverTable &d = require_vmm_driver();
  std::lock_guard<std::mutex> guard(staging.mutex);
  refuse_while_staged("cannot reserve host staging");
  const std::size_t have = mapped_bytes();
  if (have < bytes) map_extent(bytes - have, chunk_bytes);
  if (!pin_here) return 0;
  std::size_t pinned = 0;
  try {
    ScopedContext context(d, device);
    // Only as many chunks as `bytes` needs: the layout fills them from the first.
    for (std::size_t i = 0, covered = 0; i < staging.chunks.size() && covered < bytes; ++i) {
      Chunk &chunk = staging.chunks[i];
      covered += chunk.size;
      if (chunk.pinned) continue;
      // The job's CUDA calls wait while the driver pins, and back to back registrations kept
      // them waiting for all of it (H200: the job's step in flight took 0.41 s longer for
      // 16 GiB, 2.9 s for 64 GiB); a pause between chunks lets them through.
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

std::size_t stage_segments_to_host(const LiveRanges &live, std::size_t chunk_bytes) {
  check_chunk_bytes(chunk_bytes);
  const DriverTable &d = require_vmm_driver();
  RegistryLock lock(kRelocationLockTimeout);
  std::lock_guard<std::mutex> guard(staging.mutex);
  refuse_second_order();
  refuse_while_staged("cannot stage to host memory");
  staging.stashed.clear();
  staging.pieces.clear();
  const SegmentMap &segments = lock.segments();
  if (segments.empty()) return 0;
  const std::map<int, std::vector<const Segment *>> groups = by_device_to_stage(segments);
  Layout layout = plan(groups, live, chunk_bytes);
  std::vector<char> used(staging.chunks.size(), 0);
  for (const Piece &piece : layout.pieces) used[piece.chunk] = 1;
  int current = groups.begin()->first;
  try {
    bool spares_unpinned = false;
    for (const auto &group : groups) {
      current = group.first;
      ScopedContext context(d, group.first);
      FLEXIUM_CU_CALL(d, cuCtxSynchronize);  // the copies must see every write already queued
      ScopedStream stream(d);
      ChunkEvents events(d);
      std::vector<char> member(layout.stashed.size(), 0);
      for (std::size_t i = 0; i < layout.stashed.size(); ++i) member[i] = layout.stashed[i].device == group.first;
      queue_by_chunk(
          layout.pieces, member, stream.get(), events,
          [&](const Piece &piece) {
            FLEXIUM_CU_CALL(d, cuMemcpyDtoHAsync, host_of(piece), layout.stashed[piece.stashed].address + piece.offset,
                            piece.length, stream.get());
          },
          // Pinned by the reserve, unless plan() mapped it or a failure unpinned it.
          [&](std::size_t chunk) { pin(d, staging.chunks[chunk]); });
      if (!spares_unpinned) {  // while the first copies run
        for (std::size_t c = 0; c < used.size(); ++c) {
          if (!used[c]) unpin(d, staging.chunks[c]);
        }
        spares_unpinned = true;
      }
      events.each_done([&](std::size_t chunk) { unpin(d, staging.chunks[chunk]); });
      stream.synchronize();
    }
  } catch (...) {
    unpin_all_quietly(d, current);
    throw;
  }
  staging.device = current;
  const std::size_t bytes = layout.bytes;
  staging.stashed = std::move(layout.stashed);
  staging.pieces = std::move(layout.pieces);
  return bytes;
}

std::size_t restore_segments_from_host(int device) {
  const DriverTable &d = require_vmm_driver();
  RegistryLock lock(kRelocationLockTimeout);
  std::lock_guard<std::mutex> guard(staging.mutex);
  refuse_second_order();
  SegmentMap &segments = lock.segments();
  const std::map<int, std::vector<std::size_t>> groups = waiting_by_device(segments, device);
  std::size_t restored = 0;
  int current = device >= 0 ? device : staging.device;
  try {
    for (const auto &group : groups) {
      const int target = current = group.first;
      ScopedContext context(d, target);
      // Made before the stream: on failure the stream waits for its copies, then these unwind.
      std::vector<std::unique_ptr<Backing>> made = make_backings(d, target, group.second);
      ScopedStream stream(d);
      ChunkEvents events(d);
      std::vector<char> member(staging.stashed.size(), 0);
      for (const std::size_t i : group.second) member[i] = 1;
      std::size_t copied = 0;
      // Each chunk is pinned while the copies of the one before it run.
      queue_by_chunk(
          staging.pieces, member, stream.get(), events,
          [&](const Piece &piece) {
            FLEXIUM_CU_CALL(d, cuMemcpyHtoDAsync, staging.stashed[piece.stashed].address + piece.offset,
                            host_of(piece), piece.length, stream.get());
            copied += piece.length;
          },
          [&](std::size_t chunk) { pin(d, staging.chunks[chunk]); });
      events.each_done([&](std::size_t chunk) { unpin(d, staging.chunks[chunk]); });
      stream.synchronize();
      adopt_backings(d, segments, group.second, made, target);
      restored += copied;
    }
  } catch (...) {
    unpin_all_quietly(d, current);
    throw;
  }
  return restored;
}

HostOrder begin_stage_order(const LiveRanges &live, std::size_t chunk_bytes) {
  check_chunk_bytes(chunk_bytes);
  const DriverTable &d = require_vmm_driver();
  std::unique_ptr<PendingOrder> order = open_order();
  refuse_while_staged("cannot stage to host memory");
  const SegmentMap &segments = order->lock->segments();
  const std::map<int, std::vector<const Segment *>> groups = by_device_to_stage(segments);
  if (groups.size() > 1) throw std::invalid_argument("the copier stages one device's segments; the pool spans several");
  for (const auto &entry : segments) {
    if (!entry.second.exportable) {
      throw std::invalid_argument(describe(entry.second) +
                                  " came back from a driver checkpoint and cannot be exported until it is made the "
                                  "job's own again");
    }
  }
  HostOrder out;
  if (groups.empty()) {
    pending = std::move(order);
    return out;
  }
  order->device = groups.begin()->first;
  ScopedContext context(d, order->device);
  FLEXIUM_CU_CALL(d, cuCtxSynchronize);  // the copies must see every write already queued
  order->layout = plan(groups, live, chunk_bytes, /*may_grow=*/false);
  for (const Stashed &stashed : order->layout.stashed) {
    order->fds.emplace_back(export_fd(d, segments.at(stashed.address).handle));
    out.segments.emplace_back(order->fds.back().fd, stashed.size);
  }
  for (const Piece &piece : order->layout.pieces) {
    out.pieces.push_back({piece.stashed, piece.offset, piece.chunk, piece.chunk_offset, piece.length});
  }
  out.bytes = order->bytes = order->layout.bytes;
  pending = std::move(order);
  return out;
}

HostOrder begin_restore_order(int device) {
  const DriverTable &d = require_vmm_driver();
  std::unique_ptr<PendingOrder> order = open_order();
  order->restore = true;
  order->device = device >= 0 ? device : staging.device;
  std::map<int, std::vector<std::size_t>> groups = waiting_by_device(order->lock->segments(), order->device);
  HostOrder out;
  if (!groups.empty()) {
    order->indices = std::move(groups.begin()->second);
    ScopedContext context(d, order->device);
    std::vector<std::size_t> position(staging.stashed.size(), SIZE_MAX);
    try {
      order->made = make_backings(d, order->device, order->indices);
      for (std::size_t k = 0; k < order->indices.size(); ++k) {
        position[order->indices[k]] = k;
        order->fds.emplace_back(export_fd(d, order->made[k]->handle));
        out.segments.emplace_back(order->fds.back().fd, order->made[k]->size);
      }
    } catch (...) {
      order->made.clear();  // while the context is current
      throw;
    }
    for (const Piece &piece : staging.pieces) {
      if (position[piece.stashed] == SIZE_MAX) continue;
      out.pieces.push_back({position[piece.stashed], piece.offset, piece.chunk, piece.chunk_offset, piece.length});
      out.bytes += piece.length;
    }
  }
  order->bytes = out.bytes;
  pending = std::move(order);
  return out;
}

std::size_t finish_host_order() {
  if (!pending) throw std::runtime_error("no copier order is open");
  std::unique_ptr<PendingOrder> order = std::move(pending);
  if (order->restore) {
    adopt_backings(require_vmm_driver(), order->lock->segments(), order->indices, order->made, order->device);
  } else {
    staging.device = order->device;
    staging.stashed = std::move(order->layout.stashed);
    staging.pieces = std::move(order->layout.pieces);
  }
  return order->bytes;  // the fds close and the locks go with `order`
}

void abort_host_order() {
  if (!pending) return;
  std::unique_ptr<PendingOrder> order = std::move(pending);
  if (!order->made.empty()) {
    // The new memory is unmapped and released while its device's context is current.
    ScopedContext context(require_vmm_driver(), order->device);
    order->made.clear();
  }
}

HostStagingLayout host_staging_layout() {
  std::lock_guard<std::mutex> guard(staging.mutex);
  HostStagingLayout layout;
  for (const Extent &extent : staging.extents) layout.extents.emplace_back(extent.fd, extent.size);
  for (const Chunk &chunk : staging.chunks) layout.chunks.push_back({chunk.extent, chunk.offset, chunk.size});
  return layout;
}

std::size_t release_host_staging() {
  std::lock_guard<std::mutex> guard(staging.mutex);
  refuse_while_staged("cannot release host staging");
  staging.stashed.clear();
  staging.pieces.clear();
  if (std::any_of(staging.chunks.begin(), staging.chunks.end(), [](const Chunk &c) { return c.pinned; })) {
    const DriverTable &d = require_vmm_driver();
    ScopedContext context(d, staging.device);
    for (Chunk &chunk : staging.chunks) unpin(d, chunk);
  }
  // Unmapping takes the process's mmap lock for writing, and the job's page faults and the
  // driver's own mappings wait for it: unmapped whole, 16 GiB of small pages held the first step
  // after a resume up by a second. Dropped chunk by chunk (MADV_DONTNEED takes the lock for
  // reading only), with a break between, the munmap below has nothing left to do.
  for (std::size_t i = 0; i < staging.chunks.size(); ++i) {
    if (i > 0) std::this_thread::sleep_for(kUnmapBreak);
    ::madvise(staging.chunks[i].host, staging.chunks[i].size, MADV_DONTNEED);
  }
  std::size_t released = 0;
  staging.chunks.clear();
  while (!staging.extents.empty()) {
    const Extent &extent = staging.extents.back();
    ::munmap(extent.base, extent.size);
    ::close(extent.fd);  // the copier's mapping, if any, keeps the pages until it unmaps them
    released += extent.size;
    staging.extents.pop_back();
  }
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
