#include "vmm_peer_access.h"

#include "driver_error.h"
#include "vmm_driver.h"

namespace flexium {
namespace {

bool can_reach(const DriverTable &d, int from, int to) {
  CUdevice from_device = 0, to_device = 0;
  FLEXIUM_CU_CALL(d, cuDeviceGet, &from_device, from);
  FLEXIUM_CU_CALL(d, cuDeviceGet, &to_device, to);
  int can = 0;
  FLEXIUM_CU_CALL(d, cuDeviceCanAccessPeer, &can, from_device, to_device);
  return can != 0;
}

std::set<int> pool_devices(const SegmentMap &segments, const std::set<CUdeviceptr> &moving = {}) {
  std::set<int> devices;
  for (const auto &entry : segments) {
    if (moving.count(entry.first) == 0) devices.insert(entry.second.device);
  }
  return devices;
}

}  // namespace

std::vector<int> pool_access(const DriverTable &d, const SegmentMap &segments, int device,
                             const std::set<CUdeviceptr> &moving) {
  std::vector<int> access{device};
  for (const int other : pool_devices(segments, moving)) {
    if (other != device && can_reach(d, other, device)) access.push_back(other);
  }
  return access;
}

void open_pool_to(const DriverTable &d, const SegmentMap &segments, int device) {
  const std::set<int> devices = pool_devices(segments);
  if (devices.count(device) != 0) return;
  for (const int other : devices) {
    if (!can_reach(d, device, other)) continue;
    for (const auto &entry : segments) {
      const Segment &segment = entry.second;
      if (segment.device == other && segment.mapped) grant_access(d, segment.address, segment.size, {device});
    }
  }
}

}  // namespace flexium
