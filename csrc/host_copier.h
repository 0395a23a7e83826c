// The copier process's native side (python/flexium/engine/fast/host_copier_process.py runs it): it
// maps the job's host staging (memfd extents the job shares with it), pins it with a context of
// its own and copies between it and the job's segments, imported through their fds.
//
// Why a second process: pinned memory in the checkpointed process slows its checkpoint and restore,
// and unpinning in the job does not overlap its copies; pinned here, the staging costs the job's
// checkpoint nothing, and pinning overlaps the job's restore (facts
// `pinned-memory-slows-checkpoint`, `pinning-holds-job-calls` and `staging-pinned-by-copier`). The
// copier holds no GPU memory while the job is paused: sleep() unpins and drops its context.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_driver_types.h"
#include "vmm_driver.h"

namespace flexium {

// A chunk of the staging: `size` bytes at `offset` of extent `extent`.
struct CopierChunk {
  std::size_t extent = 0;
  std::size_t offset = 0;
  std::size_t size = 0;
};

// One copy: `length` bytes at `segment_offset` of segment `segment` of the order, to or from
// `chunk_offset` of chunk `chunk`.
struct CopierPiece {
  std::size_t segment = 0;
  std::size_t segment_offset = 0;
  std::size_t chunk = 0;
  std::size_t chunk_offset = 0;
  std::size_t length = 0;
};

// Thrown by wait_touched() in a pinner told to stop while it waited (stop_pinner()).
struct PinnerStopped : std::exception {
  const char *what() const noexcept override { return "the pinner was stopped"; }
};

// Where the last copy() spent its time, for the job's debug log and the benchmark.
struct CopyTimes {
  double import_s = 0;             // importing and mapping the segments
  double pin_s = 0;                // pinning the chunks the pinner thread had not reached
  double touch_wait_s = 0;         // of which waiting for the touching threads to reach them
  std::size_t pinned_in_copy = 0;  // their bytes
  double copy_s = 0;               // from the first copy queued until the last one ended
  std::size_t written = 0;         // bytes written into extents made to be written (not touched)
};

// Two per writing thread cost nothing to pin, and a buffer the GPU just filled is still in the CPU's cache
// when written out: through 1 MiB buffers a 64 GiB GPU was free 0.6 s sooner than through 16 MiB, and 0.9 s
// sooner than through 256 KiB (docs/measurements.md, runs 39a and 39b). The job's FLEXIUM_WRITE_BUFFER replaces it.
constexpr std::size_t kDefaultWriteBufferBytes = std::size_t{1} << 20;

// Why a write buffer of `bytes` cannot be used, or "" where it can: the one rule, for
// HostCopier::set_write_buffer_bytes and for FLEXIUM_WRITE_BUFFER, refused when the job starts. Whole pages
// (each is pinned), from 64 KiB (smaller costs more calls than it saves) to 256 MiB (two are pinned per
// writing thread).
std::string write_buffer_refusal(std::size_t bytes);

class HostCopier {
 public:
  // Maps each extent (fd, size) shared; the fds stay the caller's. `driver_made` (per extent; empty: none
  // is): host memory the driver made (make_host_memory), which is pinned by nature: its fd is kept (a
  // dup) and it is mapped for the GPU where a memfd chunk would be pinned. `written` (per extent; empty:
  // none is): a memfd made at a pause's safe point whose pages the first copy to host makes by writing
  // them (copier_writes.cpp) rather than touching and pinning them: not touched here, its fd kept (a dup).
  HostCopier(const std::vector<std::pair<int, std::size_t>> &extents, const std::vector<CopierChunk> &chunks,
             const std::vector<bool> &driver_made = {}, const std::vector<bool> &written = {});
  ~HostCopier();  // sleep(), quietly, then unmaps
  HostCopier(const HostCopier &) = delete;
  HostCopier &operator=(const HostCopier &) = delete;

  // Adds extents (fd, size) and chunks (whose extent indexes count the extents mapped before
  // first) to the staging grown by the job; the chunks pinned already stay pinned. Returns at once:
  // a thread per new extent touches its chunks in the background, from its start, and each pin
  // waits for its chunk (touching, pinning and copying make one pipeline).
  void extend(const std::vector<std::pair<int, std::size_t>> &extents, const std::vector<CopierChunk> &chunks,
              const std::vector<bool> &driver_made = {}, const std::vector<bool> &written = {});

  // Awake: `bytes` of host memory made by the driver (cuMemCreate on the host NUMA node of the GPU it is
  // awake on, pieces of at most `piece` bytes), exported as POSIX fds, the caller's, with their sizes; this
  // process keeps no reference. It lives while an fd or a mapping refers to it, needs no context to, and
  // is pinned: mapped for the GPU at about 100 GB/s and let go of at once (fact `driver-made-host-memory`),
  // where a memfd pins at 26-30 GB/s and unpins at 50-70. On failure nothing of it is left.
  std::vector<std::pair<int, std::size_t>> make_host_memory(std::size_t bytes, std::size_t piece);

  // Takes the primary context of the GPU with `uuid` (unless it holds it already) and pins the
  // chunks not pinned yet, in order, in a thread of its own, `pause_ms` between chunks. With
  // `wait`, returns once all are pinned (and throws if pinning failed). Returns how the pinning
  // before it ended (last_pinner(), once that pinner stopped).
  std::string wake(const std::string &uuid, bool wait, int pause_ms);

  // Copies the pieces between the chunks and the segments (fd, size) in chunk order, pinning the
  // chunks not yet pinned just before their copies (the copies of the chunk before run meanwhile).
  // With `write_untouched` a copy to host writes the memfd chunks the touching threads have not
  // reached (a young job's kept staging: docs/fast-path.md, "Written at the safe point") as it writes a
  // written extent's, and those threads stop short of them. Returns the bytes copied. The fds stay the
  // caller's; the imports are gone when it returns.
  std::size_t copy(bool to_host, const std::vector<std::pair<int, std::size_t>> &segments,
                   const std::vector<CopierPiece> &pieces, bool write_untouched = false);

  // A resume's copy back made while the driver restores the job (host_copier_fill.cpp): new memory
  // of each size on the GPU it is awake on (exportable as POSIX fds), the pieces copied into it from
  // the chunks as copy() does, and one exported fd per segment, the caller's to hand to the job.
  // The copier keeps no reference besides those fds: the memory lives while they or the job's
  // import do. On failure nothing of it is left.
  std::vector<int> fill(const std::vector<std::size_t> &sizes, const std::vector<CopierPiece> &pieces);

  // Awake: pins the chunks not pinned yet in the pinner thread, `pause_ms` between chunks, and
  // returns at once (after a copy back that keeps the staging: the copies pinned only what they used).
  void pin_rest(int pause_ms);

  // Unpins every chunk and releases the context, so the copier holds nothing on any GPU.
  void sleep();

  bool awake() const { return context_ != nullptr; }
  std::size_t pinned_bytes() const;
  std::size_t pinned_since_wake() const;  // by the last wake() and the copies after it
  // What the last wake() found pinned, once it had stopped the pinning before it (a pause that
  // came while the staging was being pinned ahead copies these chunks at once, and pins the rest).
  std::size_t pinned_at_wake() const;
  // Whether a pinner thread (of wake() or pin_rest()) is pinning now.
  bool pinning() const { return pinner_running_; }
  // How the last pinner thread (of wake() or pin_rest()) ended: what it pinned, in how long, and
  // whether it finished, was stopped or failed; "" before the first. A failure in the background
  // is reported here and so by the next wake(), which pins what is left again.
  std::string last_pinner() const;
  CopyTimes last_copy_times() const { return times_; }
  // Bytes of each of the two pinned buffers a writing thread copies through (host_copier_writes.cpp): a
  // multiple of 4 KiB, at least 64 KiB (std::invalid_argument otherwise). Set between copies.
  void set_write_buffer_bytes(std::size_t bytes);
  std::size_t write_buffer_bytes() const { return write_buffer_bytes_; }

 private:
  // wake()'s context on the GPU with `uuid` (the one it holds there already, or a new one, after a sleep
  // when it holds another's). On a throw the caller puts the copier to sleep.
  void take_context(const std::string &uuid);
  void start_pinner(int pause_ms);
  void stop_pinner();
  // Pins chunk `index` once touched; the seconds it waited for that.
  double pin_chunk(std::size_t index);
  void start_touching(std::size_t first_added, std::size_t first_chunk);
  // A thread per extent touches these chunks (not touched yet) in the background, each extent's from its start.
  void touch_chunks(const std::vector<std::size_t> &to_touch);
  void touch_extent(std::vector<std::size_t> chunks) noexcept;
  void stop_touching() noexcept;
  // Waits until the touching threads reached chunk `index`; the seconds waited.
  double wait_touched(std::size_t index);
  void require_awake(const char *what) const;
  // Checks the pieces against the segments' sizes and the chunks (std::invalid_argument).
  void check_pieces(const std::vector<std::size_t> &sizes, const std::vector<CopierPiece> &pieces) const;
  // Copies the pieces between the chunks and the segments mapped here at `addresses`, pinning each
  // chunk not pinned yet just before its copies, and waits for them; fills times_'s pin and copy.
  // The pieces to host of chunks still to be written go to write_pieces() meanwhile.
  std::size_t copy_pieces(bool to_host, const std::vector<CUdeviceptr> &addresses,
                          const std::vector<CopierPiece> &pieces);
  // copier_writes.cpp: the pieces (of chunks still to be written) copied from the GPU and written into
  // their extents' files, a thread per extent, each through two small pinned buffers of its own; the
  // chunks are then touched, not pinned. Throws the first thread's failure once all have stopped.
  std::size_t write_pieces(const std::vector<CUdeviceptr> &addresses, const std::vector<CopierPiece> &pieces);
  void write_extent(const std::vector<CUdeviceptr> &addresses, const std::vector<CopierPiece> &pieces) const;
  // Marks the chunks of these pieces that no touching thread has reached (nor will: they are claimed)
  // to be written by the copy, in memfds whose fd the copier keeps.
  void write_untouched_chunks(const std::vector<CopierPiece> &pieces);
  // After a copy to host: no chunk waits to be written any more; touching threads map the written chunks'
  // pages here (one that no piece filled, the staging's slack, is made by that), for a pin to wait for.
  void written_all();

  struct Extent {
    char *base = nullptr;  // driver-made: while mapped
    std::size_t size = 0;
    bool driver_made = false;
    bool written = false;               // made to be written by the first copy to host, not touched
    int fd = -1;                        // our dup of the job's fd (a memfd's: to write through it)
    std::shared_ptr<Backing> mapped;    // driver-made, while mapped for the GPU
  };
  void map_driver_made(Extent &extent);
  // Unmaps a memfd (`drop_first`: its pages dropped first), closes the fd kept of it.
  static void let_go(const Extent &extent, bool drop_first) noexcept;
  std::vector<Extent> extents_;
  std::vector<CopierChunk> chunks_;
  std::vector<char> pinned_;
  std::vector<char> touched_;   // under mutex_
  std::vector<char> claimed_;   // taken by a touching thread, touched or being touched (under mutex_)
  std::vector<char> to_write_;  // chunks of written extents no copy has written yet (under mutex_)
  std::condition_variable touched_cv_;
  std::vector<std::thread> touchers_;
  std::atomic<bool> stop_touching_{false};
  CUdevice device_ = 0;
  int ordinal_ = -1;
  CUcontext context_ = nullptr;
  CUstream stream_ = nullptr;
  std::thread pinner_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> pinner_running_{false};
  // Guards pinned_, touched_, claimed_, to_write_, pinned_since_wake_, pinned_at_wake_, pin_error_, last_pinner_.
  mutable std::mutex mutex_;
  std::size_t pinned_since_wake_ = 0;
  std::size_t pinned_at_wake_ = 0;
  std::string pin_error_;
  std::string last_pinner_;
  CopyTimes times_;
  std::size_t write_buffer_bytes_ = kDefaultWriteBufferBytes;
};

}  // namespace flexium
