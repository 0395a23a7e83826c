// The copier's way with a staging made at a pause's safe point (docs/fast-path.md, "Written at the safe
// point"): rather than touch the new files' pages, pin them, copy into them and unpin them before its
// context may go, it copies each piece from the GPU into one of two small pinned buffers and writes the
// other into the file meanwhile. Each page is then made once, by the write that fills it, and nothing of
// the staging is pinned when the copies end.
//
// Rules relied on:
//  - a write that fills a whole page of a shmem file (a memfd) allocates the page without clearing it
//    first, where a page fault clears it (Linux mm/shmem.c: shmem_get_folio skips the clearing for a
//    write); measured on a CPU-only host, pwrite made a memfd's pages at 2.7 GB/s a thread against 1.6
//    GB/s touching them (MADV_POPULATE_WRITE 1.8); beside the GPU's copies on H100 hosts, docs/fast-path.md
//    ("Written at the safe point") and docs/measurements.md (runs 35-37);
//  - the file's pages are the job's too: it maps the same memfd shared.
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "driver_error.h"
#include "host_copier.h"
#include "vmm_driver.h"

namespace flexium {
namespace {

// Two pinned buffers of this process's memory, unpinned and freed when it goes (after the copies into them).
class WriteBuffers {
 public:
  WriteBuffers(const DriverTable &d, std::size_t bytes) : d_(d) {
    try {
      for (int i = 0; i < 2; ++i) {
        buffers_[i] = static_cast<char *>(::operator new(bytes, std::align_val_t{4096}));
        FLEXIUM_CU_CALL(d_, cuMemHostRegister, buffers_[i], bytes, CU_MEMHOSTREGISTER_PORTABLE);
        registered_[i] = true;
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~WriteBuffers() { release(); }
  WriteBuffers(const WriteBuffers &) = delete;
  WriteBuffers &operator=(const WriteBuffers &) = delete;
  char *operator[](int turn) const { return buffers_[turn]; }

 private:
  void release() noexcept {
    for (int i = 0; i < 2; ++i) {
      if (registered_[i]) d_.cuMemHostUnregister(buffers_[i]);
      if (buffers_[i] != nullptr) ::operator delete(buffers_[i], std::align_val_t{4096});
      buffers_[i] = nullptr;
      registered_[i] = false;
    }
  }
  const DriverTable &d_;
  char *buffers_[2] = {nullptr, nullptr};
  bool registered_[2] = {false, false};
};

void write_all(int fd, const char *data, std::size_t bytes, std::size_t at) {
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, data, bytes, static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : ENOSPC;
      throw std::runtime_error(std::string("writing the host staging failed (") + std::strerror(error) +
                               "): is the host short of memory?");
    }
    data += n;
    at += static_cast<std::size_t>(n);
    bytes -= static_cast<std::size_t>(n);
  }
}

}  // namespace

std::size_t HostCopier::write_pieces(const std::vector<CUdeviceptr> &addresses,
                                     const std::vector<CopierPiece> &pieces) {
  std::vector<std::vector<CopierPiece>> by_extent(extents_.size());
  std::size_t bytes = 0;
  for (const CopierPiece &piece : pieces) {
    by_extent[chunks_[piece.chunk].extent].push_back(piece);
    bytes += piece.length;
  }
  std::vector<std::exception_ptr> failed(by_extent.size());
  std::vector<std::thread> threads;
  threads.reserve(by_extent.size());  // no allocation between two threads' starts, which could leave one unjoined
  for (std::size_t k = 0; k < by_extent.size(); ++k) {
    if (by_extent[k].empty()) continue;
    const auto work = [this, &addresses, &by_extent, &failed, k] {
      try {
        write_extent(addresses, by_extent[k]);
      } catch (...) {
        failed[k] = std::current_exception();
      }
    };
    try {
      threads.emplace_back(work);
    } catch (const std::system_error &) {
      work();  // no thread to be had: written here
    }
  }
  for (std::thread &thread : threads) thread.join();
  for (const std::exception_ptr &failure : failed) {
    if (failure) std::rethrow_exception(failure);  // the chunks stay to be written: a copy again writes them
  }
  return bytes;
}

std::string write_buffer_refusal(std::size_t bytes) {
  if (bytes >= (std::size_t{64} << 10) && bytes <= (std::size_t{256} << 20) && bytes % 4096 == 0) return "";
  return "a write buffer must be a multiple of 4 KiB from 64 KiB to 256 MiB, not " + std::to_string(bytes) + " bytes";
}

void HostCopier::set_write_buffer_bytes(std::size_t bytes) {
  const std::string refusal = write_buffer_refusal(bytes);
  if (!refusal.empty()) throw std::invalid_argument(refusal);
  write_buffer_bytes_ = bytes;
}

void HostCopier::written_all() {
  std::vector<std::size_t> to_map;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    for (std::size_t i = 0; i < to_write_.size(); ++i) {
      if (!to_write_[i]) continue;
      to_write_[i] = 0;
      to_map.push_back(i);
    }
  }
  // Written through the file, their pages are in no mapping of this process yet: a resume's pinning would
  // fault each in from the one pinner thread (64 GiB written, then pinned at a resume: 6.5 GB/s, 10 s).
  // Threads map them now, while the job is paused, as the touching threads do a new file's (a page
  // written exists: mapping it clears nothing), and a pin waits for its chunk as it does for those.
  touch_chunks(to_map);
}

void HostCopier::write_extent(const std::vector<CUdeviceptr> &addresses, const std::vector<CopierPiece> &pieces) const {
  const DriverTable &d = require_vmm_driver();
  FLEXIUM_CU_CALL(d, cuCtxSetCurrent, context_);
  const std::size_t buffer_bytes = write_buffer_bytes_;
  const WriteBuffers buffers(d, buffer_bytes);
  CUstream stream = nullptr;
  FLEXIUM_CU_CALL(d, cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING);
  // No copy may still run into a buffer as it is freed, also when one fails half way.
  struct Stream {
    const DriverTable &d;
    CUstream stream;
    ~Stream() {
      d.cuStreamSynchronize(stream);
      d.cuStreamDestroy(stream);
    }
  } owned{d, stream};
  const int fd = extents_[chunks_[pieces.front().chunk].extent].fd;
  struct Copied {
    const char *data = nullptr;
    std::size_t bytes = 0;
    std::size_t at = 0;  // in the file
  } pending;
  int turn = 0;
  for (const CopierPiece &piece : pieces) {
    const std::size_t at = chunks_[piece.chunk].offset + piece.chunk_offset;
    for (std::size_t done = 0; done < piece.length;) {
      const std::size_t n = std::min(buffer_bytes, piece.length - done);
      FLEXIUM_CU_CALL(d, cuMemcpyDtoHAsync, buffers[turn], addresses[piece.segment] + piece.segment_offset + done, n,
                      stream);
      if (pending.bytes > 0) write_all(fd, pending.data, pending.bytes, pending.at);  // beside that copy
      FLEXIUM_CU_CALL(d, cuStreamSynchronize, stream);
      pending = Copied{buffers[turn], n, at + done};
      turn ^= 1;
      done += n;
    }
  }
  if (pending.bytes > 0) write_all(fd, pending.data, pending.bytes, pending.at);
}

}  // namespace flexium
