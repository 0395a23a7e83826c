#include "vmm_registry.h"

#include <atomic>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace flexium {
namespace {

std::timed_mutex registry_mutex;
SegmentMap registry_segments;
std::atomic<std::size_t> unknown_frees{0};
std::atomic<std::uint64_t> serials{0};

}  // namespace

RegistryLock::RegistryLock(std::chrono::milliseconds timeout) : lock_(registry_mutex, std::defer_lock) {
  if (!lock_.try_lock_for(timeout)) {
    throw std::runtime_error("the VMM segment registry stayed locked for " + std::to_string(timeout.count()) + " ms");
  }
}

SegmentMap &RegistryLock::segments() { return registry_segments; }

std::vector<SegmentInfo> list_segments() {
  RegistryLock lock(kRelocationLockTimeout);
  std::vector<SegmentInfo> out;
  out.reserve(lock.segments().size());
  for (const auto &entry : lock.segments()) {
    out.push_back({entry.second.address, entry.second.size, entry.second.device, entry.second.mapped});
  }
  return out;
}

std::size_t segment_bytes_on(int device) {
  RegistryLock lock(kRelocationLockTimeout);
  std::size_t total = 0;
  for (const auto &entry : lock.segments()) {
    if (entry.second.device == device) total += entry.second.size;
  }
  return total;
}

std::size_t segment_count() {
  RegistryLock lock(kRelocationLockTimeout);
  return lock.segments().size();
}

std::size_t imported_segment_count() {
  RegistryLock lock(kRelocationLockTimeout);
  std::size_t count = 0;
  for (const auto &entry : lock.segments()) count += entry.second.imported ? 1 : 0;
  return count;
}

std::size_t segments_to_own_count() {
  RegistryLock lock(kRelocationLockTimeout);
  std::size_t count = 0;
  for (const auto &entry : lock.segments()) count += (entry.second.imported || !entry.second.exportable) ? 1 : 0;
  return count;
}

std::size_t mark_restored_by_driver() {
  RegistryLock lock(kRelocationLockTimeout);
  std::size_t count = 0;
  for (auto &entry : lock.segments()) {
    if (!entry.second.mapped || entry.second.imported) continue;
    entry.second.exportable = false;
    ++count;
  }
  return count;
}

std::uint64_t next_segment_serial() { return serials.fetch_add(1, std::memory_order_relaxed) + 1; }

std::string hex_address(CUdeviceptr address) {
  char text[32];
  std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(address));
  return text;
}

std::string describe(const Segment &segment) {
  return "segment " + hex_address(segment.address) + " (" + std::to_string(segment.size) + " bytes, device " +
         std::to_string(segment.device) + ")";
}

void count_unknown_free() { unknown_frees.fetch_add(1, std::memory_order_relaxed); }

std::size_t unknown_free_count() { return unknown_frees.load(std::memory_order_relaxed); }

}  // namespace flexium
