// Pause and resume of the segments through the host staging with the copies run in this
// process (the fallback when the copier process is off or fails), and the layout and backings
// both ways of copying share.
//
// Vendor rule relied on, with evidence: a segment's address range stays reserved across the
// checkpoint and a new allocation can be mapped there after the restore (fact
// `exported-fd-survives-checkpoint` maps the imported fd at the same address).
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "driver_error.h"
#include "vmm_host_staging.h"
#include "vmm_host_staging_state.h"

namespace flexium {
namespace host_staging {
namespace {

char *host_of(const Piece &piece) { return staging.chunks[piece.chunk].host + piece.chunk_offset; }

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

}  // namespace

// Lays the live ranges of the segments out one after the other over the chunks, each device's
// group starting on a chunk of its own (a chunk is unpinned once all its copies are done), and
// maps more staging where the chunks run out (the pool grew after the reserve).
Layout plan(const std::map<int, std::vector<const Segment *>> &groups, const LiveRanges &live, std::size_t chunk_bytes,
            bool may_grow) {
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
            map_extent(total - layout.bytes, chunk_bytes, true, true);  // at the safe point
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
  // The layout stays until the next stage or the release: restage_released_segments() may need it.
}

}  // namespace host_staging

using namespace host_staging;

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
            queue_host_copy(d, true, host_of(piece), layout.stashed[piece.stashed].address + piece.offset, piece.length,
                            stream.get(), driver_made(staging.chunks[piece.chunk]));
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

std::size_t restage_released_segments() {
  RegistryLock lock(kRelocationLockTimeout);
  std::lock_guard<std::mutex> guard(staging.mutex);
  refuse_second_order();
  const SegmentMap &segments = lock.segments();
  std::size_t waiting = 0;
  for (Stashed &stashed : staging.stashed) {
    const auto found = segments.find(stashed.address);
    if (!stashed.done || found == segments.end() || found->second.serial != stashed.serial) continue;
    if (found->second.mapped || found->second.has_handle) continue;
    stashed.done = false;
    stashed.device = found->second.device;
    ++waiting;
  }
  return waiting;
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
            queue_host_copy(d, false, host_of(piece), staging.stashed[piece.stashed].address + piece.offset,
                            piece.length, stream.get(), driver_made(staging.chunks[piece.chunk]));
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

}  // namespace flexium
