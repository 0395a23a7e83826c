#include "devices.h"

#include <cstdio>

#include "driver_error.h"
#include "driver_table.h"
#include "uuid.h"

namespace flexium {

std::vector<DeviceInfo> list_devices() {
  const DriverTable &d = require_driver();
  int count = 0;
  FLEXIUM_CU_CALL(d, cuDeviceGetCount, &count);
  std::vector<DeviceInfo> devices;
  devices.reserve(static_cast<std::size_t>(count));
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    CUdevice dev = 0;
    FLEXIUM_CU_CALL(d, cuDeviceGet, &dev, ordinal);
    DeviceInfo info;
    info.ordinal = ordinal;
    CUuuid uuid{};
    FLEXIUM_CU_CALL(d, cuDeviceGetUuid, &uuid, dev);
    info.uuid = format_uuid(uuid);
    char name[256] = {};
    FLEXIUM_CU_CALL(d, cuDeviceGetName, name, sizeof(name) - 1, dev);
    info.name = name;
    FLEXIUM_CU_CALL(d, cuDeviceTotalMem, &info.total_memory, dev);
    char bus[64] = {};
    FLEXIUM_CU_CALL(d, cuDeviceGetPCIBusId, bus, sizeof(bus) - 1, dev);
    info.pci_bus_id = bus;
    devices.push_back(std::move(info));
  }
  return devices;
}

}  // namespace flexium
