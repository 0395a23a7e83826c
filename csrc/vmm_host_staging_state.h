// The host staging's state and the helpers shared by the three files that implement
// vmm_host_staging.h: vmm_host_staging.cpp (the memory: mapped, touched, pinned, given back),
// vmm_host_copies.cpp (the copies run in this process) and vmm_host_orders.cpp (the copies run
// by the copier process). Not part of the extension's interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "vmm_driver.h"
#include "vmm_registry.h"
#include "vmm_relocate.h"

namespace flexium {
namespace host_staging {

// One memfd, mapped shared here and by the copier process; or (`driver_made`) one allocation of host
// memory the driver made in the copier (adopt_host_memory), held here by its fd alone and mapped only while
// this process's own copies use it (a process holding such memory mapped cannot be restored: fact
// `cumem-host-memory-unrestorable`); its one chunk is the whole allocation.
struct Extent {
  int fd = -1;
  char *base = nullptr;  // driver-made: while mapped here
  std::size_t size = 0;
  bool driver_made = false;
  std::shared_ptr<Backing> mapped_here;  // driver-made, while mapped here
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
};

struct Layout {
  std::vector<Stashed> stashed;
  std::vector<Piece> pieces;
  std::size_t bytes = 0;
};

extern Staging staging;

void check_chunk_bytes(std::size_t chunk_bytes);      // std::invalid_argument unless whole pages
std::size_t mapped_bytes();                          // the chunks' bytes (caller holds the mutex)
std::size_t waiting_segments();                      // staged segments not brought back yet
void refuse_while_staged(const char *what);          // std::runtime_error while any waits

// New extents of at least `bytes` in all, not pinned, cut into chunks of `chunk_bytes` (appended
// to the staging's chunks), touched here if `touch_here`: one memfd per touching thread, more of them
// when `job_stopped` (the job waits at its safe point: its cores are free).
void map_extent(std::size_t bytes, std::size_t chunk_bytes, bool touch_here, bool job_stopped);

// cuMemHostRegister, PORTABLE; once. A driver-made chunk is pinned already: it is mapped for the current
// context's device instead.
void pin(const DriverTable &d, Chunk &chunk);
void unpin(const DriverTable &d, Chunk &chunk);  // cuMemHostUnregister (driver-made: unmapped); once
bool driver_made(const Chunk &chunk);

// After a failure: nothing pinned may ride into the next checkpoint. Best effort.
void unpin_all_quietly(const DriverTable &d, int device) noexcept;

// Lays the live ranges of the segments out one after the other over the chunks, each device's
// group starting on a chunk of its own (a chunk is unpinned once all its copies are done), and
// maps more staging where the chunks run out (the pool grew after the reserve).
Layout plan(const std::map<int, std::vector<const Segment *>> &groups, const LiveRanges &live, std::size_t chunk_bytes,
            bool may_grow = true);

// The segments to stage, by device; every one must have its memory.
std::map<int, std::vector<const Segment *>> by_device_to_stage(const SegmentMap &segments);

// The staged segments that still wait for memory, by the device they go back to (`device`, or
// where each was when -1); the ones freed meanwhile or never released are marked done.
std::map<int, std::vector<std::size_t>> waiting_by_device(const SegmentMap &segments, int device);

// New memory on `target` mapped at each of the staged segments' addresses (the current context
// must be `target`'s). Undone on unwind unless adopted.
std::vector<std::unique_ptr<Backing>> make_backings(const DriverTable &d, int target,
                                                    const std::vector<std::size_t> &indices);

// The segments own their new memory (their bytes are back): the registry says so.
void adopt_backings(const DriverTable &d, SegmentMap &segments, const std::vector<std::size_t> &indices,
                    std::vector<std::unique_ptr<Backing>> &made, int target);

// Throws while a copier order is open (vmm_host_orders.cpp): it holds the segments.
void refuse_second_order();

}  // namespace host_staging
}  // namespace flexium
