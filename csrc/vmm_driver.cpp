#include "vmm_driver.h"

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "driver_error.h"

namespace flexium {
namespace {

constexpr int kCachedDevices = 64;
std::atomic<std::size_t> granularity_cache[kCachedDevices];

}  // namespace

const DriverTable &require_vmm_driver() {
  const DriverTable &d = require_driver();
#define FLEXIUM_REQUIRE_VMM(name, version, required) FLEXIUM_REQUIRE_FUNCTION(d, name);
  FLEXIUM_VMM_FUNCTIONS(FLEXIUM_REQUIRE_VMM)
#undef FLEXIUM_REQUIRE_VMM
  return d;
}

CUmemAllocationProp device_allocation_prop(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

std::size_t granularity(const DriverTable &d, int device) {
  const bool cacheable = device >= 0 && device < kCachedDevices;
  if (cacheable) {
    const std::size_t known = granularity_cache[device].load(std::memory_order_relaxed);
    if (known != 0) return known;
  }
  const CUmemAllocationProp prop = device_allocation_prop(device);
  std::size_t value = 0;
  FLEXIUM_CU_CALL(d, cuMemGetAllocationGranularity, &value, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (value == 0) {
    throw DriverError("cuMemGetAllocationGranularity", CUDA_ERROR_INVALID_VALUE,
                      "the driver reported a granularity of 0", __FILE__, __LINE__);
  }
  if (cacheable) granularity_cache[device].store(value, std::memory_order_relaxed);
  return value;
}

std::size_t round_up(std::size_t size, std::size_t step) {
  const std::size_t remainder = size % step;
  if (remainder == 0) return size;
  if (size > SIZE_MAX - (step - remainder)) {
    throw std::overflow_error("size " + std::to_string(size) + " cannot be rounded up to a multiple of " +
                              std::to_string(step));
  }
  return size + (step - remainder);
}

void grant_access(const DriverTable &d, CUdeviceptr address, std::size_t size, const std::vector<int> &devices) {
  std::vector<CUmemAccessDesc> access(devices.size());
  for (std::size_t i = 0; i < devices.size(); ++i) {
    access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[i].location.id = devices[i];
    access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  FLEXIUM_CU_CALL(d, cuMemSetAccess, address, size, access.data(), access.size());
}

bool primary_context_active(const DriverTable &d, int ordinal) {
  CUdevice device = 0;
  unsigned int flags = 0;
  int active = 0;
  return d.cuDeviceGet(&device, ordinal) == CUDA_SUCCESS &&
         d.cuDevicePrimaryCtxGetState(device, &flags, &active) == CUDA_SUCCESS && active != 0;
}

int first_device_in_use(const DriverTable &d) {
  int count = 0;
  if (d.cuDeviceGetCount(&count) != CUDA_SUCCESS) return -1;
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    if (primary_context_active(d, ordinal)) return ordinal;
  }
  return -1;
}

ScopedContext::ScopedContext(const DriverTable &d, int device) : d_(d) {
  FLEXIUM_CU_CALL(d_, cuDeviceGet, &device_, device);
  FLEXIUM_CU_CALL(d_, cuCtxGetCurrent, &previous_);
  CUcontext context = nullptr;
  FLEXIUM_CU_CALL(d_, cuDevicePrimaryCtxRetain, &context, device_);
  const CUresult set = d_.cuCtxSetCurrent(context);
  if (set != CUDA_SUCCESS) {
    d_.cuDevicePrimaryCtxRelease(device_);
    throw DriverError("cuCtxSetCurrent", set, "", __FILE__, __LINE__);
  }
}

ScopedContext::~ScopedContext() {
  d_.cuCtxSetCurrent(previous_);
  d_.cuDevicePrimaryCtxRelease(device_);
}

ScopedStream::ScopedStream(const DriverTable &d) : d_(d) {
  FLEXIUM_CU_CALL(d_, cuStreamCreate, &stream_, CU_STREAM_NON_BLOCKING);
}

ScopedStream::~ScopedStream() {
  d_.cuStreamSynchronize(stream_);
  d_.cuStreamDestroy(stream_);
}

void ScopedStream::synchronize() { FLEXIUM_CU_CALL(d_, cuStreamSynchronize, stream_); }

std::unique_ptr<Backing> map_exported(const DriverTable &d, int fd, std::size_t size, int device) {
  auto b = std::make_unique<Backing>(d);
  b->size = size;
  FLEXIUM_CU_CALL(d, cuMemImportFromShareableHandle, &b->handle,
                  reinterpret_cast<void *>(static_cast<std::intptr_t>(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  b->created = true;
  FLEXIUM_CU_CALL(d, cuMemAddressReserve, &b->address, b->size, 0, 0, 0);
  b->reserved = true;
  FLEXIUM_CU_CALL(d, cuMemMap, b->address, b->size, 0, b->handle, 0);
  b->mapped = true;
  grant_access(d, b->address, b->size, {device});
  return b;
}

void queue_host_copy(const DriverTable &d, bool to_host, char *host, CUdeviceptr device, std::size_t bytes,
                     CUstream stream, bool driver_made) {
  const CUdeviceptr at = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(host));
  if (driver_made) {
    if (to_host) {
      FLEXIUM_CU_CALL(d, cuMemcpyDtoDAsync, at, device, bytes, stream);
    } else {
      FLEXIUM_CU_CALL(d, cuMemcpyDtoDAsync, device, at, bytes, stream);
    }
  } else if (to_host) {
    FLEXIUM_CU_CALL(d, cuMemcpyDtoHAsync, host, device, bytes, stream);
  } else {
    FLEXIUM_CU_CALL(d, cuMemcpyHtoDAsync, device, host, bytes, stream);
  }
}

Backing::~Backing() {
  if (mapped) d->cuMemUnmap(address, size);
  if (created) d->cuMemRelease(handle);
  if (reserved) d->cuMemAddressFree(address, size);
}

OwnedFd::~OwnedFd() {
  if (fd >= 0) ::close(fd);
}

}  // namespace flexium
