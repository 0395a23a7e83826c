// Vendor rules relied on:
//  - memory held only by an exported fd of a cuMemCreate allocation survives the checkpoint and maps back at its
//    address (fact `exported-fd-survives-checkpoint`).
//  - an allocation lives until every mapping and handle, exported fds included, is gone (cuMemRelease docs):
//    the fd alone keeps the copy alive, and closing it frees the memory.
//  - access for both GPUs on one mapping lets the source context copy into target memory, no peer access call
//    (fact `exported-fd-survives-checkpoint`).
//  - a new mapping has no access until cuMemSetAccess (cuMemMap docs).
//  - no context of ours stays on the target to ride the checkpoint (fact `exported-fd-survives-checkpoint`).
#include "vmm_relocate.h"

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>

#include "driver_error.h"
#include "move_checksum.h"
#include "vmm_driver.h"
#include "vmm_peer_access.h"
#include "vmm_registry.h"

namespace flexium {
namespace {

// Segments of `source` (-1: all; only those in `only` unless it is empty) grouped by their
// device, in address order within each.
std::map<int, std::vector<Segment *>> by_device(SegmentMap &segments, int source, const SegmentFilter &only) {
  std::map<int, std::vector<Segment *>> groups;
  for (auto &entry : segments) {
    if (!only.empty() && only.count(entry.first) == 0) continue;
    if (source < 0 || entry.second.device == source) groups[entry.second.device].push_back(&entry.second);
  }
  return groups;
}

// A copy of one segment on the target: memory exported as an fd, mapped at a temporary address.
struct Copy {
  explicit Copy(const DriverTable &d) : temporary(d) {}
  CUdeviceptr source_address = 0;
  Backing temporary;
  OwnedFd fd;
  std::uint64_t checksum = 0;
};

thread_local std::size_t copied_bytes = 0;
thread_local double checksum_seconds = 0;

// Queues copies of the segment's live ranges (all of it when `live` does not list it) to the
// same offsets at `destination`; returns the bytes queued.
std::size_t copy_live(const DriverTable &d, const Segment &segment, CUdeviceptr destination, const LiveRanges &live,
                      CUstream stream) {
  std::size_t bytes = 0;
  for (const auto &range : live_ranges_of(segment, live)) {
    FLEXIUM_CU_CALL(d, cuMemcpyDtoDAsync, destination + range.first, segment.address + range.first, range.second,
                    stream);
    bytes += range.second;
  }
  return bytes;
}

void start_copy(const DriverTable &d, const Segment &segment, int target, CUstream stream, const LiveRanges &live,
                Copy &copy) {
  Backing &temp = copy.temporary;
  temp.size = segment.size;
  const CUmemAllocationProp prop = device_allocation_prop(target);
  FLEXIUM_CU_CALL(d, cuMemCreate, &temp.handle, segment.size, &prop, 0);
  temp.created = true;
  int fd = -1;
  FLEXIUM_CU_CALL(d, cuMemExportToShareableHandle, &fd, temp.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  copy.fd.fd = fd;
  FLEXIUM_CU_CALL(d, cuMemAddressReserve, &temp.address, segment.size, 0, 0, 0);
  temp.reserved = true;
  FLEXIUM_CU_CALL(d, cuMemMap, temp.address, segment.size, 0, temp.handle, 0);
  temp.mapped = true;
  std::vector<int> devices{segment.device};
  if (target != segment.device) devices.push_back(target);
  grant_access(d, temp.address, segment.size, devices);
  copied_bytes += copy_live(d, segment, temp.address, live, stream);
  copy.source_address = segment.address;
}

// After the copy: only the fd keeps the memory.
void drop_temporary(const DriverTable &d, Backing &temp) {
  FLEXIUM_CU_CALL(d, cuMemUnmap, temp.address, temp.size);
  temp.mapped = false;
  FLEXIUM_CU_CALL(d, cuMemAddressFree, temp.address, temp.size);
  temp.reserved = false;
  FLEXIUM_CU_CALL(d, cuMemRelease, temp.handle);
  temp.created = false;
}

// What a driver says when work for a GPU needs that GPU's context to be current.
bool wants_context(CUresult code) {
  return code == CUDA_ERROR_INVALID_CONTEXT || code == CUDA_ERROR_INVALID_DEVICE || code == CUDA_ERROR_NOT_SUPPORTED ||
         code == CUDA_ERROR_NOT_PERMITTED || code == CUDA_ERROR_CONTEXT_IS_DESTROYED;
}

// The checksum of a copy's live bytes where it landed, read in the current context.
std::uint64_t checksum_of_copy(const DriverTable &d, const Segment &segment, const Copy &copy, const LiveRanges &live) {
  std::uint64_t sum = 0;
  for (const std::uint64_t part : checksum_ranges_here(d, segment_ranges(segment, copy.temporary.address, live))) {
    sum += part;
  }
  return sum;
}

std::vector<StagedSegment> stage_groups(const DriverTable &d, const std::map<int, std::vector<Segment *>> &groups,
                                        int target, const LiveRanges &live, bool with_target_context,
                                        bool checksum_copies) {
  // Declared before the copies, so that on failure they are freed while a context is current:
  // the target's when asked for, else the first source's.
  std::optional<ScopedContext> context;
  if (with_target_context) {
    context.emplace(d, target);
  } else if (!groups.empty()) {
    context.emplace(d, groups.begin()->first);
  }
  std::vector<std::unique_ptr<Copy>> copies;
  for (const auto &group : groups) {
    ScopedContext source_context(d, group.first);
    // The copy stream is ordered after nothing: wait for every write already queued.
    FLEXIUM_CU_CALL(d, cuCtxSynchronize);
    ScopedStream stream(d);
    const std::size_t first = copies.size();
    for (const Segment *segment : group.second) {
      copies.push_back(std::make_unique<Copy>(d));
      start_copy(d, *segment, target, stream.get(), live, *copies.back());
    }
    stream.synchronize();
    if (checksum_copies) {
      const auto started = std::chrono::steady_clock::now();
      for (std::size_t k = 0; k < group.second.size(); ++k) {
        copies[first + k]->checksum = checksum_of_copy(d, *group.second[k], *copies[first + k], live);
      }
      checksum_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    }
  }
  for (auto &copy : copies) drop_temporary(d, copy->temporary);
  std::vector<StagedSegment> staged;
  staged.reserve(copies.size());
  for (auto &copy : copies) staged.push_back({copy->source_address, copy->temporary.size, copy->fd.fd, copy->checksum});
  for (auto &copy : copies) copy->fd.release();
  return staged;
}

}  // namespace

std::size_t last_staged_copy_bytes() { return copied_bytes; }

double last_staged_checksum_seconds() { return checksum_seconds; }

std::vector<std::pair<std::size_t, std::size_t>> live_ranges_of(const Segment &segment, const LiveRanges &live) {
  const auto listed = live.find(segment.address);
  if (listed == live.end()) return {{0, segment.size}};
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  for (const auto &range : listed->second) {
    if (range.first > segment.size || range.second > segment.size - range.first) {
      throw std::invalid_argument("live range (" + std::to_string(range.first) + ", " + std::to_string(range.second) +
                                  ") lies outside " + describe(segment));
    }
    if (range.second != 0) ranges.push_back(range);
  }
  return ranges;
}

std::vector<StagedSegment> stage_segments_to_device(int target, int source, const LiveRanges &live,
                                                    const SegmentFilter &only, bool checksum_copies) {
  const DriverTable &d = require_vmm_driver();
  copied_bytes = 0;
  checksum_seconds = 0;
  RegistryLock lock(kRelocationLockTimeout);
  auto groups = by_device(lock.segments(), source, only);
  for (const auto &group : groups) {
    for (const Segment *segment : group.second) {
      if (!segment->mapped || !segment->has_handle) {
        throw std::invalid_argument(describe(*segment) + " has no backing to stage");
      }
    }
  }
  // First without a context on the target (fact `no-target-context-needed`): memory can be created on, and copied into,
  // a GPU from another GPU's context. A driver that wants one gets it on the retry.
  try {
    return stage_groups(d, groups, target, live, false, checksum_copies);
  } catch (const DriverError &e) {
    if (!wants_context(e.code())) throw;
    copied_bytes = 0;
    checksum_seconds = 0;
    return stage_groups(d, groups, target, live, true, checksum_copies);
  }
}

std::size_t release_source_backing(int source, const SegmentFilter &only) {
  const DriverTable &d = require_vmm_driver();
  RegistryLock lock(kRelocationLockTimeout);
  std::size_t released = 0;
  for (auto &group : by_device(lock.segments(), source, only)) {
    ScopedContext context(d, group.first);
    FLEXIUM_CU_CALL(d, cuCtxSynchronize);  // nothing may still use the ranges we unmap
    for (Segment *segment : group.second) {
      const bool backed = segment->mapped || segment->has_handle;
      if (segment->mapped) {
        FLEXIUM_CU_CALL(d, cuMemUnmap, segment->address, segment->size);
        segment->mapped = false;
      }
      if (segment->has_handle) {
        FLEXIUM_CU_CALL(d, cuMemRelease, segment->handle);
        segment->has_handle = false;
      }
      segment->imported = false;  // no memory behind it now: whatever comes next is made or imported anew
      if (backed) ++released;
    }
  }
  return released;
}

void map_imported(const std::vector<StagedSegment> &staged, int device) {
  const DriverTable &d = require_vmm_driver();
  RegistryLock lock(kRelocationLockTimeout);
  SegmentMap &segments = lock.segments();
  // Checked before anything is done, so a bad list leaves every fd and segment as it was.
  std::set<CUdeviceptr> seen;
  for (const StagedSegment &entry : staged) {
    auto found = segments.find(entry.address);
    const std::string address = hex_address(entry.address);
    if (found == segments.end()) throw std::invalid_argument(address + " is not a segment");
    if (found->second.size != entry.size) {
      throw std::invalid_argument(describe(found->second) + " does not have the staged size " +
                                  std::to_string(entry.size));
    }
    if (found->second.mapped) throw std::invalid_argument(describe(found->second) + " is still mapped");
    if (entry.fd < 0) throw std::invalid_argument(address + " comes with no fd");
    if (!seen.insert(entry.address).second) throw std::invalid_argument(address + " is listed twice");
  }
  ScopedContext context(d, device);
  const std::vector<int> access = pool_access(d, segments, device, seen);
  for (const StagedSegment &entry : staged) {
    Segment &segment = segments.at(entry.address);
    Backing backing(d);
    backing.address = entry.address;
    backing.size = entry.size;
    FLEXIUM_CU_CALL(d, cuMemImportFromShareableHandle, &backing.handle,
                    reinterpret_cast<void *>(static_cast<std::intptr_t>(entry.fd)),
                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    backing.created = true;
    FLEXIUM_CU_CALL(d, cuMemMap, entry.address, entry.size, 0, backing.handle, 0);
    backing.mapped = true;
    grant_access(d, entry.address, entry.size, access);
    // A handle left by a release that failed half way: the new memory replaces it.
    if (segment.has_handle) d.cuMemRelease(segment.handle);
    segment.handle = backing.handle;
    segment.has_handle = true;
    segment.mapped = true;
    segment.imported = true;
    segment.device = device;
    segment.users.clear();  // new memory, open to the GPUs with pool memory only
    backing.release_to_caller();
    // Our handle now holds the memory (the fd may be closed right after importing).
    ::close(entry.fd);
  }
}

std::size_t own_imported(int device, const LiveRanges &live, std::size_t max_bytes) {
  const DriverTable &d = require_vmm_driver();
  RegistryLock lock(kRelocationLockTimeout);
  std::vector<Segment *> imported;
  for (auto &entry : lock.segments()) {
    const Segment &segment = entry.second;
    if ((segment.imported || !segment.exportable) && segment.mapped && segment.device == device) {
      imported.push_back(&entry.second);
    }
  }
  if (imported.empty()) return 0;
  ScopedContext context(d, device);
  FLEXIUM_CU_CALL(d, cuCtxSynchronize);
  ScopedStream stream(d);
  const CUmemAllocationProp prop = device_allocation_prop(device);
  const std::vector<int> access = pool_access(d, lock.segments(), device);
  const std::set<int> users = pool_users(d, lock.segments());
  std::size_t owned = 0;
  // One segment at a time, so the extra memory needed is one segment's, not the job's.
  for (Segment *segment : imported) {
    if (owned > 0 && owned >= max_bytes) break;
    Backing fresh(d);
    fresh.size = segment->size;
    FLEXIUM_CU_CALL(d, cuMemCreate, &fresh.handle, segment->size, &prop, 0);
    fresh.created = true;
    FLEXIUM_CU_CALL(d, cuMemAddressReserve, &fresh.address, segment->size, 0, 0, 0);
    fresh.reserved = true;
    FLEXIUM_CU_CALL(d, cuMemMap, fresh.address, segment->size, 0, fresh.handle, 0);
    fresh.mapped = true;
    grant_access(d, fresh.address, segment->size, access);
    copy_live(d, *segment, fresh.address, live, stream.get());
    stream.synchronize();
    // Swap: the segment's address gets the fresh memory; the imported memory goes once unmapped.
    FLEXIUM_CU_CALL(d, cuMemUnmap, segment->address, segment->size);
    const CUresult mapped = d.cuMemMap(segment->address, segment->size, 0, fresh.handle, 0);
    if (mapped != CUDA_SUCCESS) {
      // Put the imported memory back so the segment keeps its data, then report.
      const CUresult back = d.cuMemMap(segment->address, segment->size, 0, segment->handle, 0);
      if (back == CUDA_SUCCESS) grant_access(d, segment->address, segment->size, access);
      else segment->mapped = false;
      throw DriverError("cuMemMap", mapped, "mapping own memory at " + describe(*segment), __FILE__, __LINE__);
    }
    grant_access(d, segment->address, segment->size, access);
    segment->users.clear();
    open_to_pool_users(d, users, *segment);
    d.cuMemRelease(segment->handle);
    segment->handle = fresh.handle;
    segment->imported = false;
    segment->exportable = true;
    fresh.created = false;  // the segment holds it now
    owned += segment->size;
  }
  return owned;
}

}  // namespace flexium
