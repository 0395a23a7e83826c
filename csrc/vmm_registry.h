// Every segment the VMM allocator handed out, by address, under one mutex. The relocation
// primitives hold the lock for their whole run, so allocations wait instead of racing them.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "cuda_driver_types.h"

namespace flexium {

struct Segment {
  std::uint64_t serial = 0;  // unique per allocation: an address can be reused after a free
  CUdeviceptr address = 0;   // reserved for the segment's whole life: tensors point into it
  std::size_t size = 0;      // rounded to the granularity
  int device = 0;            // ordinal that has access to the mapping
  bool mapped = false;       // physical memory mapped at `address`
  bool has_handle = false;   // `handle` is held and ours to release
  // The memory came in through an fd (map_imported). The driver's checkpoint cannot restore
  // imported memory (its restore fails with CUDA_ERROR_NOT_SUPPORTED: fact `imported-memory-cannot-ride-checkpoint`),
  // so it must be replaced by memory of our own (own_imported) before any checkpoint that carries it.
  bool imported = false;
  // False once a driver checkpoint carried the memory: the allocation it restores refuses
  // cuMemExportToShareableHandle (fact `restored-memory-unexportable`), so the copier process cannot import
  // it until own_imported() gives the segment fresh memory.
  bool exportable = true;
  CUmemGenericAllocationHandle handle = 0;
  // GPUs without pool memory that the present memory was opened to (vmm_peer_access.h).
  std::set<int> users;
};

struct SegmentInfo {
  CUdeviceptr address = 0;
  std::size_t size = 0;
  int device = 0;
  bool mapped = false;  // has memory behind it (false between a release and the map back)
};

using SegmentMap = std::map<CUdeviceptr, Segment>;

// Holds the registry's mutex; throws std::runtime_error when it stays taken past `timeout`.
class RegistryLock {
 public:
  explicit RegistryLock(std::chrono::milliseconds timeout);
  SegmentMap &segments();

 private:
  std::unique_lock<std::timed_mutex> lock_;
};

// Snapshots for Python, each under the lock.
std::vector<SegmentInfo> list_segments();
std::size_t segment_bytes_on(int device);
std::size_t segment_count();
std::size_t imported_segment_count();
// Segments own_imported() replaces: imported, or not exportable since a driver restore.
std::size_t segments_to_own_count();
// After a driver restore: the segments it carried (those mapped now) are no longer exportable.
std::size_t mark_restored_by_driver();

std::uint64_t next_segment_serial();

// "0x7f00c0000000", and "segment 0x7f00c0000000 (2097152 bytes, device 0)" for messages.
std::string hex_address(CUdeviceptr address);
std::string describe(const Segment &segment);

// Frees of pointers the registry never handed out (ignored, only counted).
void count_unknown_free();
std::size_t unknown_free_count();

constexpr std::chrono::milliseconds kAllocatorLockTimeout{60000};
constexpr std::chrono::milliseconds kRelocationLockTimeout{10000};

}  // namespace flexium
