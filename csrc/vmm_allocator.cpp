#include "vmm_allocator.h"

#include <cstdint>
#include <exception>
#include <stdexcept>

#include "driver_error.h"
#include "gpu_memory_yield.h"
#include "vmm_driver.h"
#include "vmm_peer_access.h"
#include "vmm_registry.h"

namespace flexium {
namespace {

// Per thread: PyTorch calls the allocator on the thread that ran out of memory, and that is
// the thread that asks what went wrong.
thread_local std::string last_error;

void *allocate(std::size_t size, int device) {
  const DriverTable &d = require_vmm_driver();
  if (size == 0) throw std::invalid_argument("size 0 asked");
  // PyTorch has the device's context current here, but nothing guarantees it on every thread.
  ScopedContext context(d, device);
  const std::size_t rounded = round_up(size, granularity(d, device));

  Backing backing(d);
  backing.size = rounded;
  FLEXIUM_CU_CALL(d, cuMemAddressReserve, &backing.address, rounded, 0, 0, 0);
  backing.reserved = true;
  const CUmemAllocationProp prop = device_allocation_prop(device);
  CUresult created = d.cuMemCreate(&backing.handle, rounded, &prop, 0);
  // The copier's context may sit on this GPU (gpu_memory_yield.h): the job's memory comes first.
  if (created == CUDA_ERROR_OUT_OF_MEMORY && yield_gpu_memory())
    created = d.cuMemCreate(&backing.handle, rounded, &prop, 0);
  if (created != CUDA_SUCCESS) throw DriverError("cuMemCreate", created, "", __FILE__, __LINE__);
  backing.created = true;
  FLEXIUM_CU_CALL(d, cuMemMap, backing.address, rounded, 0, backing.handle, 0);
  backing.mapped = true;

  Segment segment;
  segment.serial = next_segment_serial();
  segment.address = backing.address;
  segment.size = rounded;
  segment.device = device;
  segment.mapped = true;
  segment.has_handle = true;
  segment.handle = backing.handle;
  {
    RegistryLock lock(kAllocatorLockTimeout);
    SegmentMap &segments = lock.segments();
    grant_access(d, backing.address, rounded, pool_access(d, segments, device));
    open_pool_to(d, segments, device);
    segments.emplace(segment.address, segment);
    open_pool_to_new_users(d, pool_users(d, segments), segments);  // this segment too
  }
  backing.release_to_caller();
  return reinterpret_cast<void *>(static_cast<std::uintptr_t>(segment.address));
}

// Runs every step even after one fails (each frees something of its own), then reports the first.
struct FirstFailure {
  const char *call = nullptr;
  CUresult code = CUDA_SUCCESS;
  void check(const char *name, CUresult result) {
    if (result != CUDA_SUCCESS && call == nullptr) call = name, code = result;
  }
};

// Takes the segment out of the registry; throws std::invalid_argument for an unknown address.
Segment take_segment(CUdeviceptr address, const std::uint64_t *serial) {
  RegistryLock lock(kAllocatorLockTimeout);
  auto found = lock.segments().find(address);
  if (found == lock.segments().end() || (serial != nullptr && found->second.serial != *serial)) {
    throw std::invalid_argument(hex_address(address) + " is not a segment of this allocator");
  }
  Segment segment = found->second;
  if (serial != nullptr) lock.segments().erase(found);
  return segment;
}

void release(void *ptr) {
  const DriverTable &d = require_vmm_driver();
  const CUdeviceptr address = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(ptr));
  Segment segment;
  try {
    segment = take_segment(address, nullptr);
  } catch (const std::invalid_argument &) {
    count_unknown_free();
    throw;
  }
  ScopedContext context(d, segment.device);
  // Read again: a relocation may have changed its backing while we waited for the context.
  const std::uint64_t serial = segment.serial;
  segment = take_segment(address, &serial);
  FirstFailure failure;
  if (segment.mapped) {
    // cudaFree waits for the device; cuMemUnmap is not documented to, and kernels may still
    // read the range, so wait as cudaFree would.
    failure.check("cuCtxSynchronize", d.cuCtxSynchronize());
    failure.check("cuMemUnmap", d.cuMemUnmap(segment.address, segment.size));
  }
  if (segment.has_handle) failure.check("cuMemRelease", d.cuMemRelease(segment.handle));
  failure.check("cuMemAddressFree", d.cuMemAddressFree(segment.address, segment.size));
  if (failure.call != nullptr) {
    throw DriverError(failure.call, failure.code, "freeing segment " + hex_address(address), __FILE__, __LINE__);
  }
}

template <typename Body>
void remember_failure(const char *function, Body &&body) noexcept {
  try {
    body();
  } catch (const std::exception &e) {
    try {
      last_error = std::string(function) + ": " + e.what();
    } catch (...) {
    }
  } catch (...) {
    try {
      last_error = std::string(function) + ": unknown exception";
    } catch (...) {
    }
  }
}

}  // namespace

std::string vmm_last_error() { return last_error; }

int open_pool_to_current_users() {
  if (!has_vmm_api()) return 0;
  const DriverTable &d = require_vmm_driver();
  RegistryLock lock(kAllocatorLockTimeout);
  SegmentMap &segments = lock.segments();
  // Most steps of most jobs find no other GPU in use: no context switch for them.
  const std::set<int> users = segments.empty() ? std::set<int>{} : pool_users(d, segments);
  if (users.empty()) return 0;
  // cuMemSetAccess needs a context: the pool's own GPU's, which the job has anyway.
  ScopedContext context(d, segments.begin()->second.device);
  return open_pool_to_new_users(d, users, segments);
}

}  // namespace flexium

extern "C" {

void *flexium_vmm_alloc(std::size_t size, int device, cudaStream_t stream) noexcept {
  (void)stream;  // VMM allocations are not stream-ordered
  void *address = nullptr;
  flexium::remember_failure("flexium_vmm_alloc", [&] { address = flexium::allocate(size, device); });
  return address;
}

void flexium_vmm_free(void *ptr, std::size_t size, int device, cudaStream_t stream) noexcept {
  (void)size, (void)device, (void)stream;
  flexium::remember_failure("flexium_vmm_free", [&] { flexium::release(ptr); });
}

const char *flexium_vmm_last_error(void) noexcept { return flexium::last_error.c_str(); }

}  // extern "C"
