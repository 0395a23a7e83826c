// Which GPUs may reach the pool's memory. A process that uses several GPUs (DataParallel's scatter
// and gather, a model split over devices) copies and runs kernels on one GPU's memory from another;
// PyTorch runs a copy between GPUs on the source GPU, so GPU 1 writes into GPU 0's pool for a gather.
// VMM memory is reachable only from the devices cuMemSetAccess names (cudaDeviceEnablePeerAccess,
// which PyTorch calls, covers only memory of cudaMalloc), so every segment is opened to every GPU
// the process uses and that can reach it, and to no other: access for a GPU the process does not
// use would put state there (docs/fast-path.md fact 2). The pool is on the job's own GPU only, so
// the other GPUs a process uses are those whose primary context is active (PyTorch's own allocator
// there); while a move is in flight only the GPUs with pool memory count (the target's context is
// active then, and the old GPU must not stay mapped).
#pragma once

#include <set>
#include <vector>

#include "driver_table.h"
#include "vmm_registry.h"

namespace flexium {

// `device`, then every other device that has a segment in `segments` (not counting those at
// `moving`, which are coming to `device`) and can reach `device`'s memory: the access list of a
// segment of `device`. The registry lock must be held.
std::vector<int> pool_access(const DriverTable &d, const SegmentMap &segments, int device,
                             const std::set<CUdeviceptr> &moving = {});

// Before the first segment of `device` joins `segments`: opens the mapped segments of the other
// devices to it where it can reach them. The registry lock must be held.
void open_pool_to(const DriverTable &d, const SegmentMap &segments, int device);

// pool_access, plus every other GPU the process uses (its primary context active) that can reach
// `device`'s memory: the access list of a segment made while the job trains. Registry lock held.
std::vector<int> training_access(const DriverTable &d, const SegmentMap &segments, int device);

// Opens the mapped segments to each GPU the process has begun to use since the last call (its
// primary context active, no pool memory of its own) where that GPU can reach them; returns how
// many GPUs it opened them to. Registry lock held.
int open_pool_to_new_users(const DriverTable &d, const SegmentMap &segments);

// After segments got memory opened to the GPUs with pool memory only (a move): the next
// open_pool_to_new_users opens them to every GPU the process uses then. Registry lock held.
void forget_pool_users();

}  // namespace flexium
