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

// Opens one mapped range of `device` to `user` where it can reach it; false where it could not.
bool open_to(const DriverTable &d, CUdeviceptr address, std::size_t size, int device, int user) {
  try {
    if (!can_reach(d, user, device)) return false;
    grant_access(d, address, size, {user});
    return true;
  } catch (const DriverError &) {
    return false;
  }
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

// Best effort, like everything done for these GPUs here: an allocation never fails for their sake.
std::set<int> pool_users(const DriverTable &d, const SegmentMap &segments) {
  std::set<int> users;
  int count = 0;
  if (d.cuDeviceGetCount(&count) != CUDA_SUCCESS) return users;
  const std::set<int> in_pool = pool_devices(segments);
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    if (in_pool.count(ordinal) == 0 && primary_context_active(d, ordinal)) users.insert(ordinal);
  }
  return users;
}

std::set<int> open_to_pool_users(const DriverTable &d, const std::set<int> &users, Segment &segment) {
  std::set<int> opened;
  for (const int user : users) {
    if (user == segment.device || segment.users.count(user) != 0) continue;
    if (open_to(d, segment.address, segment.size, segment.device, user))
      segment.users.insert(user), opened.insert(user);
  }
  return opened;
}

int open_pool_to_new_users(const DriverTable &d, const std::set<int> &users, SegmentMap &segments) {
  std::set<int> reached;
  for (auto &entry : segments) {
    if (!entry.second.mapped) continue;
    const std::set<int> opened = open_to_pool_users(d, users, entry.second);
    reached.insert(opened.begin(), opened.end());
  }
  return static_cast<int>(reached.size());
}

}  // namespace flexium
