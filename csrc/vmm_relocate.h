// The fast path's moves of the allocator's segments from one GPU to another, around a driver
// checkpoint (docs/fast-path.md; fact `exported-fd-survives-checkpoint`). Run with the process
// RUNNING, never while it is locked: every call here is a CUDA call and would block (fact
// `locked-process-blocks-cuda`). Each takes the segment registry's lock for its whole run and
// throws DriverError naming the failed call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "cuda_driver_types.h"

namespace flexium {

// Bytes of one segment held only by an exported POSIX fd, to be mapped back at `address`.
struct StagedSegment {
  CUdeviceptr address = 0;
  std::size_t size = 0;
  int fd = -1;
  std::uint64_t checksum = 0;  // of the copy's live bytes (move_checksum.h), when asked for
};

// Byte ranges (offset, length) of a segment that hold live data; a segment listed with no
// ranges is all free cache. Segments not listed are copied whole.
using LiveRanges = std::map<CUdeviceptr, std::vector<std::pair<std::size_t, std::size_t>>>;

// The ranges of `segment` to copy: its listed live ranges (empty ones dropped), or the whole
// segment when `live` does not list it. Throws std::invalid_argument for a range outside it.
struct Segment;
std::vector<std::pair<std::size_t, std::size_t>> live_ranges_of(const Segment &segment, const LiveRanges &live);

// Copies every segment (of device `source`; -1: of every device) into new memory on device
// `target` and returns that memory as fds, the caller's to pass to map_imported or close (closing
// frees the copy). Only the `live` ranges of a listed segment are copied: the rest of its new
// memory is left as it comes. The segments themselves are untouched. All or nothing: on failure
// every copy made so far is freed.
// `only` (if not empty) limits the work to those segments, here and in release_source_backing.
// With `checksum_copies`, each copy's checksum is computed where it landed, before it is handed
// over (read by the source GPU: the target has no context of ours), into StagedSegment::checksum.
using SegmentFilter = std::set<CUdeviceptr>;
std::vector<StagedSegment> stage_segments_to_device(int target, int source = -1, const LiveRanges &live = {},
                                                    const SegmentFilter &only = {}, bool checksum_copies = false);

// Bytes stage_segments_to_device copied in this thread's last call, and the seconds it spent on
// the copies' checksums.
std::size_t last_staged_copy_bytes();
double last_staged_checksum_seconds();

// Unmaps every segment (of `source`; -1: all) and releases its memory; the address ranges stay
// reserved. Returns how many segments lost their backing. On failure the registry still says
// which segments are backed.
std::size_t release_source_backing(int source = -1, const SegmentFilter &only = {});

// Maps each fd's memory at its segment's address (the segment must have no backing and the same
// size), grants `device` access and closes the fd. The caller keeps the fds of the entries not
// mapped when this throws (the failed one included): they are the only reference to that data.
void map_imported(const std::vector<StagedSegment> &staged, int device);

// Replaces the imported memory of `device`'s segments (and the memory a driver restore left
// unexportable) with memory of our own, copying the `live`
// ranges (whole segments where not listed), one segment at a time, in address order, stopping
// once `max_bytes` are replaced (at least one segment). Returns the bytes replaced.
std::size_t own_imported(int device, const LiveRanges &live = {}, std::size_t max_bytes = SIZE_MAX);

}  // namespace flexium
