// Pause and resume of the allocator's segments through host memory: the host side of the fast
// path (docs/fast-path.md, "Fast pause"). Same rules as
// vmm_relocate.h: process RUNNING, registry lock held while segments are touched, DriverError
// naming the failed call.
//
// The staging is host memory (memfds the copier process maps too), touched ahead of a pause and
// pinned (cuMemHostRegister) only while copies run through it: pinned memory in the process slows
// the driver's checkpoint and restore, unpinned memory does not (fact `pinned-memory-slows-checkpoint`).
// Implemented in vmm_host_staging.cpp (the memory), vmm_host_copies.cpp (copies in this process)
// and vmm_host_orders.cpp (copies by the copier).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "host_copier.h"
#include "vmm_relocate.h"

namespace flexium {

constexpr std::size_t kDefaultHostChunkBytes = std::size_t{256} << 20;

// Runs work(0) .. work(count - 1), each in a thread of its own (this one runs the first, and those no
// thread could be had for); returns once all ended. `work` must not throw.
void each_in_a_thread(std::size_t count, const std::function<void(std::size_t)> &work);

// Faults the pages of each range in (allocating them where the memfd has none yet), one thread per
// range. Registering memory whose pages are not mapped in the registering process runs at about 4
// GB/s, mapped at about 30 GB/s (facts `fallocate-no-faster` and `staging-kept-pinned-ahead`):
// whoever pins, touches first.
void populate_host_pages(const std::vector<std::pair<char *, std::size_t>> &ranges);

// Makes the staging hold at least `bytes`, all of it pinned, ahead of a pause: maps and touches
// what is missing (several threads, huge pages where the kernel gives them) and registers every
// chunk with `device`'s context (host memory the driver made, pinned by nature, is left unmapped:
// the copies map it while they run). Takes seconds for tens of GiB, never the registry lock, so the
// job keeps training meanwhile. Returns the bytes pinned by this call. On failure nothing stays
// pinned. Throws std::runtime_error while segments are staged.
// With `pin_here` false it only maps: the copier process touches and pins instead (host_copier.h).
// `job_stopped`: the job waits at its safe point (a pause that makes its staging there), so the
// staging gets a file per core, up to 16, for as many touching threads; else up to 8, half the cores.
std::size_t reserve_host_staging(std::size_t bytes, int device, std::size_t chunk_bytes = kDefaultHostChunkBytes,
                                 bool pin_here = true, bool job_stopped = false);

// Copies the `live` ranges of every segment (whole segments where not listed) into the staging,
// in pieces of at most `chunk_bytes`, and unpins each chunk as soon as its copies are done, so
// the checkpoint that follows sees no pinned memory. Grows the staging if the pool outgrew it.
// Segments stay as they are: call release_source_backing() next. Returns the bytes copied.
// Throws std::runtime_error while segments are staged; on a driver failure nothing is staged.
std::size_t stage_segments_to_host(const LiveRanges &live = {}, std::size_t chunk_bytes = kDefaultHostChunkBytes);

// Gives each staged segment new memory on `device` (-1: the device it had), mapped at its own
// address, and copies its bytes back, pinning each chunk just before its copies and unpinning it
// after them. Segments freed meanwhile are dropped; ones already mapped are skipped, so a failed
// restore can be retried (on another device too). Returns the bytes copied back. The staging
// stays mapped (unpinned) until release_host_staging().
std::size_t restore_segments_from_host(int device = -1);

// After a copy back whose bytes did not check out (move_checksum.h) and whose memory was released
// again (release_source_backing): the restored segments wait in the staging again, which still
// holds their bytes, for the next restore_segments_from_host or restore order. Returns how many.
std::size_t restage_released_segments();

// While `hurried` (someone waits for a release_host_staging under way, or about to start: a pause that
// needs its room), the release drops what is left at once, a thread per extent, rather than chunk by
// chunk with a break between them, which spares a training job's page faults.
void set_host_release_hurried(bool hurried);

// Unpins and unmaps the staging; returns the bytes given back. `keep_driver_made`: the host memory
// the driver made stays (a staging kept in part within the pinned budget, whose memfds made at the
// safe point go). Throws std::runtime_error while it holds segments not restored.
std::size_t release_host_staging(bool keep_driver_made = false);

// ---- The same moves with the copies run by the copier process --------------------------------
// The staging is memfds (extents) the copier maps too. An order lists the segments as exported
// fds and the copies as pieces in chunk order; between begin and finish/abort this thread holds
// the registry lock (no allocation touches a segment while the copier copies it).
struct HostOrder {
  std::vector<std::pair<int, std::size_t>> segments;  // (fd, size): the order's to close, not the caller's
  std::vector<CopierPiece> pieces;
  std::size_t bytes = 0;
};

struct HostStagingLayout {
  std::vector<std::pair<int, std::size_t>> extents;  // (memfd, size): the staging's own fds
  std::vector<CopierChunk> chunks;
  std::vector<bool> driver_made;  // per extent: host memory the driver made (adopt_host_memory), not a memfd
};

HostStagingLayout host_staging_layout();

// Adds host memory the driver made in the copier process (HostCopier::make_host_memory: cuMemCreate on the
// host, exported as POSIX fds, which become the staging's) to the staging, a chunk per allocation. It is
// pinned by nature and needs no context to live, so a staging of it stays pinned through a pause and a
// resume copies from it without pinning again (fact `driver-made-host-memory`). Held here by its fds
// only. Returns the staging's bytes. Throws std::runtime_error while segments are staged.
std::size_t adopt_host_memory(const std::vector<std::pair<int, std::size_t>> &allocations);

// Lays out the live ranges of the segments (one device's) over the staging, which must already
// be large enough (std::length_error otherwise: stage in-process instead, which grows it), after
// synchronizing their device. finish_host_order() then records them as staged.
HostOrder begin_stage_order(const LiveRanges &live = {}, std::size_t chunk_bytes = kDefaultHostChunkBytes);

// New memory on `device` (-1: where the segments were) mapped at each staged segment's address;
// finish_host_order() hands it to the segments once the copier has copied their bytes in.
HostOrder begin_restore_order(int device = -1);

std::size_t finish_host_order();  // returns the order's bytes
void abort_host_order();          // undoes what begin did; the staging is as before it

// ---- The resume's copy back made by the copier while the driver restores (host_copier_fill.cpp) --------
// The copier makes the segments' new memory in its own context and fills it; the job plans the order
// before its restore (no CUDA call: it may run while the process is checkpointed) and adopts the
// memory after it, through the fds the copier exported.
struct FillSegment {
  CUdeviceptr address = 0;
  std::size_t size = 0;
  std::uint64_t serial = 0;
};

struct FillOrder {
  std::vector<FillSegment> segments;  // the staged segments waiting for memory, in the pieces' numbering
  std::vector<CopierPiece> pieces;    // in chunk order, as for a restore order
  std::size_t bytes = 0;
};

// The segments waiting in the staging and their pieces. Takes the registry lock and the staging's mutex
// only while it reads them.
FillOrder plan_fill_order();

// Maps the memory of each fd (one per segment of `order`, from the copier's fill) at its segment's
// address for `device`, as memory imported from another process: the segment is marked imported and not
// exportable (an imported allocation cannot be exported again: fact `exported-fd-survives-checkpoint`,
// its holder mode) until own_imported() gives it memory of the job's own. A segment freed or brought back
// meanwhile is skipped. Every fd is closed when it returns, also when it throws; the segments it did not
// map wait in the staging as before. Returns the bytes of the pieces of the segments it mapped.
std::size_t adopt_filled_segments(const FillOrder &order, const std::vector<int> &fds, int device);

std::size_t host_staging_pool_bytes();     // host bytes the staging holds (mapped)
std::size_t host_staging_pinned_bytes();   // of those, pinned now
std::size_t host_staged_segments();        // segments waiting in it

}  // namespace flexium
