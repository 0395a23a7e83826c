// Pause and resume of the segments through the host staging with the copies run by the copier
// process (host_copier.h): orders that export the segments as fds and list the copies, holding
// the registry lock from begin until finish or abort.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

#include "driver_error.h"
#include "vmm_host_staging.h"
#include "vmm_host_staging_state.h"

namespace flexium {
namespace host_staging {
namespace {

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

void refuse_second_order() {
  if (pending) throw std::runtime_error("a copier order is already open: finish or abort it first");
}

}  // namespace host_staging

using namespace host_staging;

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
                                  " came back from a driver checkpoint, or from the copier process at a resume, and "
                                  "cannot be exported until it is made the job's own again");
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

}  // namespace flexium
