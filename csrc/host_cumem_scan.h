// The process's cuMem allocations that live in host memory and are mapped for the CPU, as NCCL makes
// its shared host memory unless NCCL_CUMEM_HOST_ENABLE=0: the driver's restore of a process holding
// one fails, and the process never runs CUDA again (docs/facts.md fact 26), so flexium refuses to
// pause or move it.
// Such memory is a shared mapping of /proc/self/maps (of /dev/nvidiactl), among the driver's own
// mappings of that file; the driver tells them apart, for it retains a handle only from an address
// of a cuMem allocation, and that handle's properties say where the memory lives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <istream>
#include <string>
#include <vector>

#include "driver_table.h"

namespace flexium {

struct HostCuMemMapping {
  std::uint64_t address = 0;
  std::size_t size = 0;      // of the mapping /proc/self/maps shows
  std::string location;      // "host", "host NUMA node N", "the host NUMA node of the thread that made it"
};

// Every shared mapping listed in `maps` (the format of /proc/self/maps) that starts at a cuMem
// allocation located on the host. Needs d.cuMemRetainAllocationHandle,
// d.cuMemGetAllocationPropertiesFromHandle and d.cuMemRelease, and a current context.
std::vector<HostCuMemMapping> host_cumem_mappings(const DriverTable &d, std::istream &maps);

// Those of this process, with the loaded driver, from any thread (none when the driver lacks the
// VMM API: such a driver has no checkpoint API); a DriverError when no driver loaded.
std::vector<HostCuMemMapping> host_cumem_mappings();

}  // namespace flexium
