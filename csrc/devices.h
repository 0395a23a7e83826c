// What the driver says about the GPUs this process can see (CUDA_VISIBLE_DEVICES applies).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace flexium {

struct DeviceInfo {
  int ordinal = 0;
  std::string uuid;         // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it
  std::string name;
  std::size_t total_memory = 0;
  std::string pci_bus_id;
};

// Note: after a remapped restore the driver keeps reporting the pre-migration identity
// (fact `remap-keeps-old-identity`), so callers snapshot this before the first migration.
std::vector<DeviceInfo> list_devices();

}  // namespace flexium
