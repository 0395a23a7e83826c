#include "uncheckpointable_memory.h"

#include <exception>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "driver_error.h"
#include "vmm_driver.h"

namespace flexium {
namespace {

bool parse_mapping(const std::string &line, std::uint64_t &start, std::uint64_t &end, bool &shared) {
  std::istringstream fields(line);
  std::string range, permissions;
  if (!(fields >> range >> permissions) || permissions.size() < 4) return false;
  const std::size_t dash = range.find('-');
  if (dash == std::string::npos) return false;
  try {
    start = std::stoull(range.substr(0, dash), nullptr, 16);
    end = std::stoull(range.substr(dash + 1), nullptr, 16);
  } catch (const std::exception &) {
    return false;
  }
  shared = permissions[3] == 's';
  return end > start;
}

// Where a cuMem allocation's memory lives, if on the host; "" for device memory. Properties the
// driver will not give are named as unknown: refusing a move is safe, a missed one is not.
std::string host_location(const DriverTable &d, CUmemGenericAllocationHandle handle) {
  CUmemAllocationProp prop{};
  if (d.cuMemGetAllocationPropertiesFromHandle(&prop, handle) != CUDA_SUCCESS) {
    return "unknown (the driver did not say)";
  }
  switch (prop.location.type) {
    case CU_MEM_LOCATION_TYPE_HOST: return "host";
    case CU_MEM_LOCATION_TYPE_HOST_NUMA: return "host NUMA node " + std::to_string(prop.location.id);
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: return "the host NUMA node of the thread that made it";
    default: return "";
  }
}

bool is_managed(const DriverTable &d, std::uint64_t address) {
  unsigned int managed = 0;
  return d.cuPointerGetAttribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, address) == CUDA_SUCCESS && managed != 0;
}

}  // namespace

std::vector<UncheckpointableMapping> uncheckpointable_mappings(const DriverTable &d, std::istream &maps) {
  FLEXIUM_REQUIRE_FUNCTION(d, cuPointerGetAttribute);
  FLEXIUM_REQUIRE_FUNCTION(d, cuMemRetainAllocationHandle);
  FLEXIUM_REQUIRE_FUNCTION(d, cuMemGetAllocationPropertiesFromHandle);
  FLEXIUM_REQUIRE_FUNCTION(d, cuMemRelease);
  std::vector<UncheckpointableMapping> found;
  std::string line;
  while (std::getline(maps, line)) {
    std::uint64_t start = 0, end = 0;
    bool shared = false;
    if (!parse_mapping(line, start, end, shared) || !shared) continue;
    const auto size = static_cast<std::size_t>(end - start);
    if (is_managed(d, start)) {
      found.push_back({start, size, "managed", ""});
      continue;
    }
    CUmemGenericAllocationHandle handle = 0;
    // Fails (CUDA_ERROR_INVALID_VALUE) for every mapping that is not a cuMem allocation's.
    if (d.cuMemRetainAllocationHandle(&handle, reinterpret_cast<void *>(start)) != CUDA_SUCCESS) continue;
    std::string location = host_location(d, handle);
    d.cuMemRelease(handle);
    if (!location.empty()) found.push_back({start, size, "host cuMem", std::move(location)});
  }
  return found;
}

std::vector<UncheckpointableMapping> uncheckpointable_mappings() {
  // A driver without the VMM API (older than CUDA 11) made no such memory, and cannot checkpoint.
  if (!has_vmm_api()) return {};
  const DriverTable &d = require_vmm_driver();
  std::ifstream maps("/proc/self/maps");
  if (!maps) throw std::runtime_error("cannot read /proc/self/maps");
  // cuMemRelease of the retained handles wants a current context: the caller's, else that of a GPU
  // the process uses already (never a new one: a context puts state on its GPU, fact `pool-on-job-gpu-only`).
  CUcontext current = nullptr;
  if (d.cuCtxGetCurrent(&current) == CUDA_SUCCESS && current != nullptr) return uncheckpointable_mappings(d, maps);
  const int device = first_device_in_use(d);
  if (device < 0) return {};  // no CUDA state in the process, so no such memory either
  ScopedContext context(d, device);
  return uncheckpointable_mappings(d, maps);
}

}  // namespace flexium
