// The job's side of a resume whose copy back the copier runs while the driver restores (vmm_host_staging.h,
// host_copier_fill.cpp): the order planned before the restore, the copier's memory adopted after it.
//
// Vendor rule relied on: a segment's address range stays reserved across the checkpoint and memory
// imported from an fd can be mapped there after the restore (fact `exported-fd-survives-checkpoint`).
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "driver_error.h"
#include "vmm_host_staging.h"
#include "vmm_host_staging_state.h"
#include "vmm_peer_access.h"

namespace flexium {

using namespace host_staging;

FillOrder plan_fill_order() {
  RegistryLock lock(kRelocationLockTimeout);
  std::lock_guard<std::mutex> guard(staging.mutex);
  refuse_second_order();
  // Every waiting segment in one group: they all go to the job's one device.
  const std::map<int, std::vector<std::size_t>> groups = waiting_by_device(lock.segments(), 0);
  FillOrder out;
  if (groups.empty()) return out;
  const std::vector<std::size_t> &indices = groups.begin()->second;
  std::vector<std::size_t> position(staging.stashed.size(), SIZE_MAX);
  for (std::size_t k = 0; k < indices.size(); ++k) {
    const Stashed &stashed = staging.stashed[indices[k]];
    position[indices[k]] = k;
    out.segments.push_back({stashed.address, stashed.size, stashed.serial});
  }
  for (const Piece &piece : staging.pieces) {
    if (position[piece.stashed] == SIZE_MAX) continue;
    out.pieces.push_back({position[piece.stashed], piece.offset, piece.chunk, piece.chunk_offset, piece.length});
    out.bytes += piece.length;
  }
  return out;
}

std::size_t adopt_filled_segments(const FillOrder &order, const std::vector<int> &fds, int device) {
  std::vector<OwnedFd> owned;
  owned.reserve(fds.size());
  for (const int fd : fds) owned.emplace_back(fd);  // closed at the end, whatever happens
  if (fds.size() != order.segments.size()) {
    throw std::invalid_argument("the copier sent " + std::to_string(fds.size()) + " fds for " +
                                std::to_string(order.segments.size()) + " segments");
  }
  const DriverTable &d = require_vmm_driver();
  RegistryLock lock(kRelocationLockTimeout);
  std::lock_guard<std::mutex> guard(staging.mutex);
  refuse_second_order();
  SegmentMap &segments = lock.segments();
  std::vector<std::size_t> piece_bytes(order.segments.size(), 0);
  for (const CopierPiece &piece : order.pieces) {
    if (piece.segment < piece_bytes.size()) piece_bytes[piece.segment] += piece.length;
  }
  std::set<CUdeviceptr> coming;
  for (const FillSegment &filled : order.segments) coming.insert(filled.address);
  ScopedContext context(d, device);
  const std::vector<int> access = pool_access(d, segments, device, coming);
  std::size_t adopted = 0;
  for (std::size_t k = 0; k < order.segments.size(); ++k) {
    const FillSegment &filled = order.segments[k];
    Stashed *stashed = nullptr;
    for (Stashed &candidate : staging.stashed) {
      if (!candidate.done && candidate.address == filled.address && candidate.serial == filled.serial) {
        stashed = &candidate;
      }
    }
    const auto found = segments.find(filled.address);
    if (stashed == nullptr || found == segments.end() || found->second.serial != filled.serial ||
        found->second.mapped || found->second.size != filled.size) {
      continue;  // freed or brought back meanwhile: its fd closes, and the copier's memory with it
    }
    Segment &segment = found->second;
    Backing backing(d);
    backing.address = filled.address;
    backing.size = filled.size;
    FLEXIUM_CU_CALL(d, cuMemImportFromShareableHandle, &backing.handle,
                    reinterpret_cast<void *>(static_cast<std::intptr_t>(owned[k].fd)),
                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    backing.created = true;
    FLEXIUM_CU_CALL(d, cuMemMap, filled.address, filled.size, 0, backing.handle, 0);
    backing.mapped = true;
    grant_access(d, filled.address, filled.size, access);
    if (segment.has_handle) d.cuMemRelease(segment.handle);  // left by a release that failed half way
    segment.handle = backing.handle;
    segment.has_handle = segment.mapped = true;
    segment.imported = true;
    segment.exportable = false;
    segment.device = device;
    segment.users.clear();  // new memory, open to the GPUs with pool memory only
    backing.release_to_caller();
    stashed->done = true;
    adopted += piece_bytes[k];
  }
  return adopted;
}

}  // namespace flexium
