// Which GPUs may reach the pool's memory. A process that uses several GPUs (DataParallel's scatter
// and gather, a model split over devices) copies and runs kernels on one GPU's memory from another.
// VMM memory is reachable only from the devices cuMemSetAccess names (cudaDeviceEnablePeerAccess,
// which PyTorch calls, covers only memory of cudaMalloc), so every segment is opened to every GPU
// the process has pool memory on and that can reach it, and to no other: access for a GPU the
// process does not use would put state there (docs/fast-path.md fact 2).
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

}  // namespace flexium
