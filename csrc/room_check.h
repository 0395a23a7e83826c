// The last look at a GPU's free memory before a restore, from inside the locked section. A restore
// that finds too little room fails and leaves the process unrestorable for good (fact
// `restore-without-room-loses-process`), and another process may take the memory while a large job
// is being checkpointed (seconds). No NVML or CUDA call of a locked process returns (fact
// `locked-process-blocks-cuda`), so the job's NVML reader process (python/flexium/engine/nvml.py
// --serve) is asked over its pipes.
#pragma once

#include <string>

namespace flexium {

struct RoomQuery {
  int request_fd = -1;  // the reader's stdin
  int reply_fd = -1;    // its stdout
  std::string uuid;     // "GPU-..."
  unsigned long long needed = 0;
  unsigned timeout_ms = 2000;
};

struct RoomAnswer {
  bool known = false;  // false: the reader gave no usable answer in time (why_unknown says why)
  unsigned long long free_bytes = 0;
  std::string why_unknown;
};

// Writes "free UUID\n" and reads one line: the GPU's free bytes, or -1 where NVML cannot tell.
RoomAnswer ask_free_memory(const RoomQuery &query);

}  // namespace flexium
