// Vendor rules relied on:
//  - memory pinned here and mapped shared by the job is ordinary memory to the job's checkpoint
//    (fact `staging-pinned-by-copier`).
//  - registering a chunk does not hold up copies already queued (fact `staging-pinned-by-copier`).
//  - releasing the last reference to the primary context destroys it (a bare one costs 518 MiB:
//    fact `staging-pinned-by-copier`).
#include "host_copier.h"

#include <fcntl.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <system_error>

#include "devices.h"
#include "driver_error.h"
#include "vmm_driver.h"
#include "vmm_host_staging.h"

namespace flexium {
namespace {

constexpr std::chrono::seconds kTouchWait{600};

// The ordinal of the GPU with `uuid` among those this process sees.
int ordinal_of(const std::string &uuid) {
  for (const DeviceInfo &device : list_devices()) {
    if (::strcasecmp(device.uuid.c_str(), uuid.c_str()) == 0) return device.ordinal;
  }
  throw std::invalid_argument("no GPU with UUID " + uuid + " is visible to the copier (CUDA_VISIBLE_DEVICES?)");
}

// The host NUMA node of the GPU `ordinal` (its PCI device's, as the kernel says), 0 where none is said.
int host_numa_node(int ordinal) {
  for (const DeviceInfo &device : list_devices()) {
    if (device.ordinal != ordinal) continue;
    unsigned domain = 0, bus = 0, slot = 0, function = 0;
    if (std::sscanf(device.pci_bus_id.c_str(), "%x:%x:%x.%x", &domain, &bus, &slot, &function) != 4) return 0;
    char path[96];
    std::snprintf(path, sizeof path, "/sys/bus/pci/devices/%04x:%02x:%02x.%x/numa_node", domain, bus, slot, function);
    std::FILE *file = std::fopen(path, "r");
    int node = -1;
    if (file != nullptr) {
      if (std::fscanf(file, "%d", &node) != 1) node = -1;
      std::fclose(file);
    }
    return std::max(node, 0);
  }
  return 0;
}

}  // namespace

HostCopier::HostCopier(const std::vector<std::pair<int, std::size_t>> &extents, const std::vector<CopierChunk> &chunks,
                       const std::vector<bool> &driver_made, const std::vector<bool> &written) {
  extend(extents, chunks, driver_made, written);
}

void HostCopier::extend(const std::vector<std::pair<int, std::size_t>> &extents, const std::vector<CopierChunk> &chunks,
                        const std::vector<bool> &driver_made, const std::vector<bool> &written) {
  for (const auto *flags : {&driver_made, &written}) {
    if (!flags->empty() && flags->size() != extents.size()) {
      throw std::invalid_argument(std::string(flags == &written ? "written" : "driver_made") + " names " +
                                  std::to_string(flags->size()) + " extents of " + std::to_string(extents.size()));
    }
  }
  stop_pinner();  // it reads chunks_; wake() starts it again for the new chunks
  std::vector<Extent> added;
  const auto unmap_added = [&added] {
    for (const Extent &mapped : added) let_go(mapped, false);
  };
  for (std::size_t k = 0; k < extents.size(); ++k) {
    const auto &extent = extents[k];
    if (!driver_made.empty() && driver_made[k]) {
      const int fd = ::fcntl(extent.first, F_DUPFD_CLOEXEC, 0);  // the job's fd is closed after the request
      if (fd < 0) {
        const int error = errno;
        unmap_added();
        throw std::runtime_error(std::string("could not keep the fd of the job's host memory: ") +
                                 std::strerror(error));
      }
      Extent made;
      made.size = extent.second;
      made.driver_made = true;
      made.fd = fd;
      added.push_back(made);
      continue;
    }
    void *base = ::mmap(nullptr, extent.second, PROT_READ | PROT_WRITE, MAP_SHARED, extent.first, 0);
    if (base == MAP_FAILED) {
      const int error = errno;
      unmap_added();
      throw std::runtime_error("could not map " + std::to_string(extent.second) +
                               " bytes of the job's host staging: " + std::strerror(error));
    }
    ::madvise(base, extent.second, MADV_HUGEPAGE);
    Extent mapped;
    mapped.base = static_cast<char *>(base);
    mapped.size = extent.second;
    mapped.written = !written.empty() && written[k];
    // Written through it (a written extent, or chunks a copy reaches before the touching does): the job closes its own.
    mapped.fd = ::fcntl(extent.first, F_DUPFD_CLOEXEC, 0);
    if (mapped.fd < 0) {
      const int error = errno;
      ::munmap(base, extent.second);
      unmap_added();
      throw std::runtime_error(std::string("could not keep the fd of the job's host staging: ") + std::strerror(error));
    }
    added.push_back(mapped);
  }
  const std::size_t first_added = extents_.size();
  for (const CopierChunk &chunk : chunks) {
    const std::size_t k = chunk.extent;
    const std::size_t size = k < first_added                  ? extents_[k].size
                             : k - first_added < added.size() ? added[k - first_added].size
                                                              : 0;
    if (size == 0 || chunk.size == 0 || chunk.offset > size || chunk.size > size - chunk.offset) {
      unmap_added();
      throw std::invalid_argument("chunk (extent " + std::to_string(chunk.extent) + ", offset " +
                                  std::to_string(chunk.offset) + ", " + std::to_string(chunk.size) +
                                  " bytes) lies outside the staging's extents");
    }
  }
  stop_touching();  // the chunks of the extents before are touched (it stops only in the destructor)
  const std::size_t first_chunk = chunks_.size();
  extents_.insert(extents_.end(), added.begin(), added.end());
  {
    std::lock_guard<std::mutex> guard(mutex_);
    chunks_.insert(chunks_.end(), chunks.begin(), chunks.end());
    pinned_.resize(chunks_.size(), 0);
    touched_.resize(chunks_.size(), 0);
    claimed_.resize(chunks_.size(), 0);
    to_write_.resize(chunks_.size(), 0);
    // Chunks of extents mapped before were touched (or written) then; driver-made memory needs no touching;
    // a written extent's pages are made by the first copy to host.
    for (std::size_t i = first_chunk; i < chunks_.size(); ++i) {
      const std::size_t k = chunks_[i].extent;
      to_write_[i] = k >= first_added && extents_[k].written ? 1 : 0;
      touched_[i] = k < first_added || extents_[k].driver_made ? 1 : 0;
    }
  }
  start_touching(first_added, first_chunk);
}

// The job only made the files: the pages are allocated (or, kept from before, mapped) here, where
// they are pinned; one thread per file (fact `staging-kept-pinned-ahead`: threads faulting one file
// wait on each other), each from the file's start, which is the order the copies take its chunks.
void HostCopier::start_touching(std::size_t first_added, std::size_t first_chunk) {
  std::vector<std::size_t> to_touch;
  for (std::size_t i = first_chunk; i < chunks_.size(); ++i) {
    const Extent &extent = extents_[chunks_[i].extent];
    if (chunks_[i].extent >= first_added && !extent.driver_made && !extent.written) to_touch.push_back(i);
  }
  touch_chunks(to_touch);
}

void HostCopier::touch_chunks(const std::vector<std::size_t> &to_touch) {
  std::vector<std::vector<std::size_t>> by_extent(extents_.size());
  for (const std::size_t i : to_touch) by_extent[chunks_[i].extent].push_back(i);
  for (std::vector<std::size_t> &chunks : by_extent) {
    if (chunks.empty()) continue;
    std::sort(chunks.begin(), chunks.end(),
              [this](std::size_t a, std::size_t b) { return chunks_[a].offset < chunks_[b].offset; });
    try {
      touchers_.emplace_back(&HostCopier::touch_extent, this, chunks);
    } catch (const std::system_error &) {
      touch_extent(chunks);  // no thread to be had: touched here, before the reply
    }
  }
}

void HostCopier::touch_extent(std::vector<std::size_t> chunks) noexcept {
  for (const std::size_t i : chunks) {
    if (stop_touching_) return;
    {
      // A chunk a copy writes is left to it until written; one another thread took is touched there.
      std::lock_guard<std::mutex> guard(mutex_);
      if (to_write_[i] || claimed_[i]) continue;
      claimed_[i] = 1;
    }
    const CopierChunk &chunk = chunks_[i];
    populate_host_pages({{extents_[chunk.extent].base + chunk.offset, chunk.size}});
    {
      std::lock_guard<std::mutex> guard(mutex_);
      touched_[i] = 1;
    }
    touched_cv_.notify_all();
  }
}

void HostCopier::stop_touching() noexcept {
  for (std::thread &toucher : touchers_) toucher.join();
  touchers_.clear();
}

double HostCopier::wait_touched(std::size_t index) {
  const auto started = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  // A chunk takes a fraction of a second to touch (10-12 GB/s, fact `staging-kept-pinned-ahead`): one
  // not touched after minutes never will be. A pinner told to stop waits no more.
  if (!touched_cv_.wait_for(lock, kTouchWait, [&] { return touched_[index] != 0 || stop_; })) {
    throw std::runtime_error("chunk " + std::to_string(index) + " of the host staging was not touched within " +
                             std::to_string(kTouchWait.count()) + " s");
  }
  if (touched_[index] == 0) throw PinnerStopped();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
}

HostCopier::~HostCopier() {
  // The pinner first: it may wait for a chunk the touching threads, once stopped, would never reach.
  stop_pinner();
  stop_touching_ = true;
  stop_touching();
  try {
    sleep();
  } catch (...) {
    // The process is going away: its exit unpins and frees whatever is left.
  }
  // A thread per extent: unmapping tens of GiB of small pages takes a thread a second or more, and a
  // pause after the resume that gave the staging back waits for it (fact `staging-given-back`).
  each_in_a_thread(extents_.size(), [this](std::size_t k) { let_go(extents_[k], true); });
}

void HostCopier::let_go(const Extent &extent, bool drop_first) noexcept {
  if (extent.fd >= 0) ::close(extent.fd);  // driver-made: its mapping for the GPU went with sleep()
  if (extent.driver_made) return;
  // Dropped first, which runs beside other threads where munmap (the mmap lock taken for writing) would not.
  if (drop_first) ::madvise(extent.base, extent.size, MADV_DONTNEED);
  ::munmap(extent.base, extent.size);
}

std::string HostCopier::wake(const std::string &uuid, bool wait, int pause_ms) {
  stop_pinner();
  const std::string before = last_pinner();
  try {
    take_context(uuid);
  } catch (...) {
    // A wake that failed leaves the copier asleep, holding nothing on any GPU, as its job then believes.
    try {
      sleep();
    } catch (...) {
    }
    throw;
  }
  const std::size_t found_pinned = pinned_bytes();
  {
    std::lock_guard<std::mutex> guard(mutex_);
    pinned_since_wake_ = 0;
    pinned_at_wake_ = found_pinned;
  }
  // Awake already, the pinner may have stopped, or chunks been added since (extend()).
  start_pinner(pause_ms);
  if (wait) {
    if (pinner_.joinable()) pinner_.join();
    std::lock_guard<std::mutex> guard(mutex_);
    if (!pin_error_.empty()) throw std::runtime_error("pinning the host staging failed: " + pin_error_);
  }
  return before;
}

void HostCopier::take_context(const std::string &uuid) {
  const DriverTable &d = require_vmm_driver();
  const int ordinal = ordinal_of(uuid);
  if (context_ != nullptr && ordinal != ordinal_) sleep();
  if (context_ != nullptr) return;
  FLEXIUM_CU_CALL(d, cuDeviceGet, &device_, ordinal);
  CUcontext context = nullptr;
  FLEXIUM_CU_CALL(d, cuDevicePrimaryCtxRetain, &context, device_);
  context_ = context;  // sleep() lets it go should what follows fail
  ordinal_ = ordinal;
  FLEXIUM_CU_CALL(d, cuCtxSetCurrent, context_);
  FLEXIUM_CU_CALL(d, cuStreamCreate, &stream_, CU_STREAM_NON_BLOCKING);
}

void HostCopier::start_pinner(int pause_ms) {
  stop_pinner();
  {
    std::lock_guard<std::mutex> guard(mutex_);
    pin_error_.clear();
  }
  pinner_running_ = true;
  try {
    pinner_ = std::thread([this, pause_ms] {
      const auto started = std::chrono::steady_clock::now();
      std::size_t chunks = 0, bytes = 0;
      double slowest = 0;
      std::string ending = "all pinned";
      try {
        FLEXIUM_CU_CALL(require_vmm_driver(), cuCtxSetCurrent, context_);
        for (std::size_t i = 0; i < chunks_.size(); ++i) {
          if (stop_) {
            ending = "stopped";
            break;
          }
          {
            std::lock_guard<std::mutex> guard(mutex_);
            if (pinned_[i] || to_write_[i]) continue;  // one to be written: its pages are not made yet
          }
          const auto pin_start = std::chrono::steady_clock::now();
          pin_chunk(i);
          slowest =
              std::max(slowest, std::chrono::duration<double>(std::chrono::steady_clock::now() - pin_start).count());
          ++chunks;
          bytes += chunks_[i].size;
          if (pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
        }
      } catch (const PinnerStopped &) {
        ending = "stopped";
      } catch (const std::exception &e) {
        std::lock_guard<std::mutex> guard(mutex_);
        pin_error_ = e.what();
        ending = std::string("failed: ") + e.what();
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      char summary[200];
      std::snprintf(summary, sizeof summary, "pinned %zu chunks (%.2f GiB) in %.2f s (the slowest %.0f ms), ", chunks,
                    static_cast<double>(bytes) / static_cast<double>(std::size_t{1} << 30), seconds, slowest * 1e3);
      std::lock_guard<std::mutex> guard(mutex_);
      last_pinner_ = summary + ending;
      pinner_running_ = false;
    });
  } catch (...) {
    pinner_running_ = false;  // no thread to be had
    throw;
  }
}

void HostCopier::pin_rest(int pause_ms) {
  require_awake("cannot pin");
  start_pinner(pause_ms);
}

double HostCopier::pin_chunk(std::size_t index) {
  const DriverTable &d = require_vmm_driver();
  const double waited = wait_touched(index);  // registering untouched memory faults it in at ~4 GB/s
  const CopierChunk &chunk = chunks_[index];
  Extent &extent = extents_[chunk.extent];
  if (extent.driver_made) {
    if (!extent.mapped) map_driver_made(extent);
  } else {
    FLEXIUM_CU_CALL(d, cuMemHostRegister, extent.base + chunk.offset, chunk.size, CU_MEMHOSTREGISTER_PORTABLE);
  }
  std::lock_guard<std::mutex> guard(mutex_);
  pinned_[index] = 1;
  pinned_since_wake_ += chunk.size;
  return waited;
}

void HostCopier::map_driver_made(Extent &extent) {
  extent.mapped = map_exported(require_vmm_driver(), extent.fd, extent.size, ordinal_);
  extent.base = reinterpret_cast<char *>(static_cast<std::uintptr_t>(extent.mapped->address));
}

std::vector<std::pair<int, std::size_t>> HostCopier::make_host_memory(std::size_t bytes, std::size_t piece) {
  require_awake("cannot make host memory");
  const DriverTable &d = require_vmm_driver();
  FLEXIUM_CU_CALL(d, cuCtxSetCurrent, context_);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  prop.location.id = host_numa_node(ordinal_);
  std::size_t step = 0;
  FLEXIUM_CU_CALL(d, cuMemGetAllocationGranularity, &step, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (step == 0) throw std::runtime_error("the driver reported a granularity of 0 for host memory");
  piece = round_up(std::max(piece, step), step);
  std::vector<OwnedFd> made;
  std::vector<std::size_t> sizes;
  for (std::size_t done = 0; done < bytes;) {
    const std::size_t size = std::min(piece, round_up(bytes - done, step));
    Backing allocation(d);  // our handle goes at the end of the scope: the fd holds the memory
    FLEXIUM_CU_CALL(d, cuMemCreate, &allocation.handle, size, &prop, 0);
    allocation.created = true;
    int fd = -1;
    FLEXIUM_CU_CALL(d, cuMemExportToShareableHandle, &fd, allocation.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0);
    made.emplace_back(fd);
    sizes.push_back(size);
    done += size;
  }
  std::vector<std::pair<int, std::size_t>> out;
  for (std::size_t i = 0; i < made.size(); ++i) out.emplace_back(made[i].release(), sizes[i]);
  return out;
}

void HostCopier::stop_pinner() {
  {
    std::lock_guard<std::mutex> guard(mutex_);  // a pinner waiting for a chunk to be touched sees it
    stop_ = true;
  }
  touched_cv_.notify_all();
  if (pinner_.joinable()) pinner_.join();
  stop_ = false;
}

void HostCopier::require_awake(const char *what) const {
  if (context_ == nullptr) throw std::runtime_error(std::string(what) + ": the copier is asleep: wake it first");
}

void HostCopier::check_pieces(const std::vector<std::size_t> &sizes, const std::vector<CopierPiece> &pieces) const {
  for (const CopierPiece &piece : pieces) {
    if (piece.segment >= sizes.size() || piece.chunk >= chunks_.size() || piece.segment_offset > sizes[piece.segment] ||
        piece.length > sizes[piece.segment] - piece.segment_offset || piece.chunk_offset > chunks_[piece.chunk].size ||
        piece.length > chunks_[piece.chunk].size - piece.chunk_offset) {
      throw std::invalid_argument("piece of " + std::to_string(piece.length) + " bytes (segment " +
                                  std::to_string(piece.segment) + " + " + std::to_string(piece.segment_offset) +
                                  ", chunk " + std::to_string(piece.chunk) + " + " +
                                  std::to_string(piece.chunk_offset) + ") lies outside its segment or chunk");
    }
  }
}

std::size_t HostCopier::copy(bool to_host, const std::vector<std::pair<int, std::size_t>> &segments,
                             const std::vector<CopierPiece> &pieces, bool write_untouched) {
  require_awake("cannot copy");
  const DriverTable &d = require_vmm_driver();
  std::vector<std::size_t> sizes;
  for (const auto &segment : segments) sizes.push_back(segment.second);
  check_pieces(sizes, pieces);
  times_ = CopyTimes{};
  stop_pinner();  // this thread pins what is left, between the copies
  if (to_host && write_untouched) write_untouched_chunks(pieces);
  FLEXIUM_CU_CALL(d, cuCtxSetCurrent, context_);
  const auto import_start = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<Backing>> imports;
  std::vector<CUdeviceptr> addresses;
  imports.reserve(segments.size());
  for (const auto &segment : segments) {
    imports.push_back(map_exported(d, segment.first, segment.second, ordinal_));
    addresses.push_back(imports.back()->address);
  }
  times_.import_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - import_start).count();
  return copy_pieces(to_host, addresses, pieces);
}

std::size_t HostCopier::copy_pieces(bool to_host, const std::vector<CUdeviceptr> &addresses,
                                    const std::vector<CopierPiece> &pieces) {
  const DriverTable &d = require_vmm_driver();
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  const Clock::time_point copy_start = Clock::now();
  // No copy may still run into memory the caller unmaps next, also when one fails half way.
  struct Drain {
    const DriverTable &d;
    CUstream stream;
    ~Drain() { d.cuStreamSynchronize(stream); }
  } drain{d, stream_};
  std::vector<CopierPiece> to_write, here;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    for (const CopierPiece &piece : pieces) {
      if (!to_write_[piece.chunk]) {
        here.push_back(piece);
      } else if (to_host) {
        to_write.push_back(piece);
      } else {
        throw std::invalid_argument("chunk " + std::to_string(piece.chunk) +
                                    " of the host staging was never written: nothing to copy back from it");
      }
    }
  }
  std::size_t copied = 0;
  // The written extents' threads run beside this one's copies; their failure is thrown once all stopped.
  std::exception_ptr write_failed;
  std::thread writer;
  const auto write = [&] {
    try {
      times_.written = write_pieces(addresses, to_write);
    } catch (...) {
      write_failed = std::current_exception();
    }
  };
  bool write_here = false;
  if (!to_write.empty()) {
    try {
      writer = std::thread(write);
    } catch (const std::system_error &) {
      write_here = true;  // no thread to be had: written after this thread's copies
    }
  }
  struct JoinWriter {
    std::thread &writer;
    ~JoinWriter() {
      if (writer.joinable()) writer.join();
    }
  } join_writer{writer};
  for (const CopierPiece &piece : here) {
    bool pinned = false;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      pinned = pinned_[piece.chunk] != 0;
    }
    if (!pinned) {
      const Clock::time_point pin_start = Clock::now();
      times_.touch_wait_s += pin_chunk(piece.chunk);
      times_.pin_s += seconds_since(pin_start);
      times_.pinned_in_copy += chunks_[piece.chunk].size;
    }
    const CopierChunk &chunk = chunks_[piece.chunk];
    const Extent &extent = extents_[chunk.extent];
    queue_host_copy(d, to_host, extent.base + chunk.offset + piece.chunk_offset,
                    addresses[piece.segment] + piece.segment_offset, piece.length, stream_, extent.driver_made);
    copied += piece.length;
  }
  FLEXIUM_CU_CALL(d, cuStreamSynchronize, stream_);
  if (write_here) write();
  if (writer.joinable()) writer.join();
  if (write_failed) std::rethrow_exception(write_failed);
  if (to_host) written_all();
  times_.copy_s = seconds_since(copy_start);
  return copied + times_.written;
}

void HostCopier::write_untouched_chunks(const std::vector<CopierPiece> &pieces) {
  std::lock_guard<std::mutex> guard(mutex_);
  for (const CopierPiece &piece : pieces) {
    const std::size_t i = piece.chunk;
    const Extent &extent = extents_[chunks_[i].extent];
    if (claimed_[i] || touched_[i] || pinned_[i] || extent.driver_made || extent.fd < 0) continue;
    to_write_[i] = 1;
  }
}

void HostCopier::sleep() {
  stop_pinner();
  if (context_ == nullptr) return;
  const DriverTable &d = require_vmm_driver();
  FLEXIUM_CU_CALL(d, cuCtxSetCurrent, context_);
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    if (!pinned_[i]) continue;
    const CopierChunk &chunk = chunks_[i];
    // Driver-made memory stays pinned without a context: only its mapping for the GPU goes (below).
    if (!extents_[chunk.extent].driver_made) {
      FLEXIUM_CU_CALL(d, cuMemHostUnregister, extents_[chunk.extent].base + chunk.offset);
    }
    std::lock_guard<std::mutex> guard(mutex_);
    pinned_[i] = 0;
  }
  for (Extent &extent : extents_) {
    extent.mapped.reset();  // 34 ms per 16 GiB (fact `driver-made-host-memory`)
    if (extent.driver_made) extent.base = nullptr;
  }
  if (stream_ != nullptr) {
    FLEXIUM_CU_CALL(d, cuStreamDestroy, stream_);
    stream_ = nullptr;
  }
  FLEXIUM_CU_CALL(d, cuCtxSetCurrent, nullptr);
  // The last reference: the driver destroys the context and gives its memory back.
  FLEXIUM_CU_CALL(d, cuDevicePrimaryCtxRelease, device_);
  context_ = nullptr;
  ordinal_ = -1;
}

std::size_t HostCopier::pinned_since_wake() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return pinned_since_wake_;
}

std::size_t HostCopier::pinned_at_wake() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return pinned_at_wake_;
}

std::string HostCopier::last_pinner() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return last_pinner_;
}

std::size_t HostCopier::pinned_bytes() const {
  std::lock_guard<std::mutex> guard(mutex_);
  std::size_t total = 0;
  for (std::size_t i = 0; i < chunks_.size(); ++i) total += pinned_[i] ? chunks_[i].size : 0;
  return total;
}

}  // namespace flexium
