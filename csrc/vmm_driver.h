// What the VMM allocator and the relocation primitives share: the driver with every VMM
// symbol, allocation properties, access grants, a scoped current context and small RAII owners.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "cuda_driver_types.h"
#include "driver_table.h"

namespace flexium {

// The loaded driver, or a DriverError naming the first VMM function it lacks.
const DriverTable &require_vmm_driver();

// Device memory on `device`, exportable as a POSIX fd: the fast path hands that fd across the
// checkpoint (fact `exported-fd-survives-checkpoint`).
CUmemAllocationProp device_allocation_prop(int device);

// The recommended granularity of `device` (the probe of fact `exported-fd-survives-checkpoint`
// rounded to it), cached per device.
std::size_t granularity(const DriverTable &d, int device);

// Rounds up to a multiple of `step`; throws std::overflow_error past SIZE_MAX.
std::size_t round_up(std::size_t size, std::size_t step);

// Read/write access for each of `devices`; a new mapping has none until this is called.
void grant_access(const DriverTable &d, CUdeviceptr address, std::size_t size, const std::vector<int> &devices);

// The first GPU whose primary context is active in this process (one it uses), -1 for none.
int first_device_in_use(const DriverTable &d);

// Whether `ordinal`'s primary context is active in this process (false where it cannot be read).
bool primary_context_active(const DriverTable &d, int ordinal);

// Makes `device`'s primary context current on this thread for the scope, retained so that it
// cannot go away meanwhile; the previous current context (maybe none) comes back at the end and
// the retain is released, so a context we created is destroyed again (fact `exported-fd-survives-checkpoint`: no
// context of ours needs to stay on the target).
class ScopedContext {
 public:
  ScopedContext(const DriverTable &d, int device);
  ~ScopedContext();
  ScopedContext(const ScopedContext &) = delete;
  ScopedContext &operator=(const ScopedContext &) = delete;

 private:
  const DriverTable &d_;
  CUdevice device_ = 0;
  CUcontext previous_ = nullptr;
};

// A stream of the current context, destroyed at the end of the scope (after a best-effort
// synchronize, so no copy still runs into memory that the caller frees next).
class ScopedStream {
 public:
  explicit ScopedStream(const DriverTable &d);
  ~ScopedStream();
  ScopedStream(const ScopedStream &) = delete;
  ScopedStream &operator=(const ScopedStream &) = delete;
  CUstream get() const { return stream_; }
  void synchronize();  // throws DriverError

 private:
  const DriverTable &d_;
  CUstream stream_ = nullptr;
};

// Physical memory of one allocation mapped at an address: whatever part exists is undone in
// reverse order on destruction unless released to the caller. Never throws from the destructor.
struct Backing {
  const DriverTable *d = nullptr;
  CUdeviceptr address = 0;
  std::size_t size = 0;
  bool reserved = false;  // we reserved `address` here and free it on unwind
  bool created = false;   // `handle` is ours to release
  CUmemGenericAllocationHandle handle = 0;
  bool mapped = false;

  explicit Backing(const DriverTable &table) : d(&table) {}
  ~Backing();
  Backing(const Backing &) = delete;
  Backing &operator=(const Backing &) = delete;
  void release_to_caller() { reserved = created = mapped = false; }
};

// The memory of an exported allocation (`fd`, `size` bytes) imported and mapped at an address of this
// process for `device`'s access; unmapped and released when the Backing goes. The fd stays the caller's.
std::unique_ptr<Backing> map_exported(const DriverTable &d, int fd, std::size_t size, int device);

// Queues one copy between device memory and host memory at `host` on `stream`: pinned host memory, or
// (`driver_made`) host memory the driver made (cuMemCreate on the host) mapped for the device, whose
// address is a device address and which is copied as device memory.
void queue_host_copy(const DriverTable &d, bool to_host, char *host, CUdeviceptr device, std::size_t bytes,
                     CUstream stream, bool driver_made);

// An fd closed on destruction unless released to the caller.
struct OwnedFd {
  int fd = -1;
  OwnedFd() = default;
  explicit OwnedFd(int f) : fd(f) {}
  ~OwnedFd();
  OwnedFd(OwnedFd &&other) noexcept : fd(other.fd) { other.fd = -1; }
  OwnedFd &operator=(OwnedFd &&) = delete;
  OwnedFd(const OwnedFd &) = delete;
  int release() {
    const int f = fd;
    fd = -1;
    return f;
  }
};

}  // namespace flexium
