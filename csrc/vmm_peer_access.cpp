#include "vmm_peer_access.h"

#include <iterator>

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

// The devices whose primary context is active in this process: the GPUs it uses.
std::set<int> active_devices(const DriverTable &d) {
  int count = 0;
  FLEXIUM_CU_CALL(d, cuDeviceGetCount, &count);
  std::set<int> active;
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    CUdevice device = 0;
    FLEXIUM_CU_CALL(d, cuDeviceGet, &device, ordinal);
    unsigned int flags = 0;
    int is_active = 0;
    FLEXIUM_CU_CALL(d, cuDevicePrimaryCtxGetState, device, &flags, &is_active);
    if (is_active != 0) active.insert(ordinal);
  }
  return active;
}

// GPUs without pool memory that open_pool_to_new_users opened the pool to (under the registry lock).
std::set<int> &opened_users() {
  static std::set<int> opened;
  return opened;
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

std::vector<int> training_access(const DriverTable &d, const SegmentMap &segments, int device) {
  std::vector<int> access = pool_access(d, segments, device);
  const std::set<int> in_pool = pool_devices(segments);
  for (const int user : active_devices(d)) {
    if (user != device && in_pool.count(user) == 0 && can_reach(d, user, device)) access.push_back(user);
  }
  return access;
}

int open_pool_to_new_users(const DriverTable &d, const SegmentMap &segments) {
  int newly = 0;
  const std::set<int> in_pool = pool_devices(segments);
  const std::set<int> active = active_devices(d);
  // A GPU the process stopped using is new again when it comes back (its context was destroyed).
  std::set<int> &opened = opened_users();
  for (auto it = opened.begin(); it != opened.end();) it = active.count(*it) != 0 ? std::next(it) : opened.erase(it);
  for (const int user : active) {
    if (in_pool.count(user) != 0 || !opened.insert(user).second) continue;
    ++newly;
    for (const auto &entry : segments) {
      const Segment &segment = entry.second;
      if (segment.mapped && segment.device != user && can_reach(d, user, segment.device)) {
        grant_access(d, segment.address, segment.size, {user});
      }
    }
  }
  return newly;
}

void forget_pool_users() { opened_users().clear(); }

}  // namespace flexium
