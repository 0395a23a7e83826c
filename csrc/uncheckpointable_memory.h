// Memory the driver's checkpoint cannot carry, found in the process: managed (UVM) memory, which
// the checkpoint refuses (fact `managed-memory-refused`), and cuMem allocations located on the host
// and mapped for the CPU, as NCCL makes its shared host memory unless NCCL_CUMEM_HOST_ENABLE=0,
// whose restore fails and leaves the process never running CUDA again (fact
// `cumem-host-memory-unrestorable`). flexium refuses to pause or move a process holding either.
// Both are shared mappings of /proc/self/maps (of /dev/nvidia-uvm and /dev/nvidiactl), among the
// driver's own mappings of those files; the driver tells them apart: it says which address is
// managed, and it retains a handle only from an address of a cuMem allocation, whose properties say
// where the memory lives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <istream>
#include <string>
#include <vector>

#include "driver_table.h"

namespace flexium {

struct UncheckpointableMapping {
  std::uint64_t address = 0;
  std::size_t size = 0;  // of the mapping /proc/self/maps shows
  std::string kind;      // "managed" or "host cuMem"
  std::string location;  // host cuMem: "host", "host NUMA node N", "the host NUMA node of the thread that made it"
};

// Every shared mapping listed in `maps` (the format of /proc/self/maps) that starts at managed
// memory or at a cuMem allocation located on the host. Needs d.cuPointerGetAttribute,
// d.cuMemRetainAllocationHandle, d.cuMemGetAllocationPropertiesFromHandle and d.cuMemRelease, and
// a current context.
std::vector<UncheckpointableMapping> uncheckpointable_mappings(const DriverTable &d, std::istream &maps);

// Those of this process, with the loaded driver, from any thread (none when the driver lacks the
// VMM API: such a driver has no checkpoint API); a DriverError when no driver loaded.
std::vector<UncheckpointableMapping> uncheckpointable_mappings();

}  // namespace flexium
