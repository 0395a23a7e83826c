// Which GPUs may reach the pool's memory. A process that uses several GPUs (DataParallel's scatter
// and gather, a model split over devices) copies and runs kernels on one GPU's memory from another;
// PyTorch runs a copy between GPUs on the source GPU, so GPU 1 writes into GPU 0's pool for a gather.
// VMM memory is reachable only from the devices cuMemSetAccess names (cudaDeviceEnablePeerAccess,
// which PyTorch calls, covers only memory of cudaMalloc), so every segment is opened to every GPU
// the process uses and that can reach it, and to no other: access for a GPU the process does not
// use would put state there (fact `pool-on-job-gpu-only`). The pool is on the job's own GPU only, so
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

// The GPUs other than those with pool memory whose primary context is active in this process: the
// other GPUs it uses (best effort: a GPU whose state cannot be read is left out). Registry lock held.
std::set<int> pool_users(const DriverTable &d, const SegmentMap &segments);

// Opens `segment`'s present memory to each of `users` it is not open to yet where that GPU can
// reach it, and records it in segment.users; best effort (a GPU that cannot be opened stays as
// before, and is tried again at the next look). Returns the GPUs it opened it to.
std::set<int> open_to_pool_users(const DriverTable &d, const std::set<int> &users, Segment &segment);

// The pool's look: every mapped segment opened to each of `users` (pool_users); returns how many
// GPUs got access to something. Registry lock held, and a context current (cuMemSetAccess).
int open_pool_to_new_users(const DriverTable &d, const std::set<int> &users, SegmentMap &segments);

}  // namespace flexium
