// GPU memory for PyTorch through the driver's virtual memory API, one segment per call, each
// exportable as a POSIX fd so that the fast path can carry it across a checkpoint.
//
// PyTorch loads these by name: torch.cuda.memory.CUDAPluggableAllocator(flexium._C.__file__,
// "flexium_vmm_alloc", "flexium_vmm_free"). Its MallocFuncType/FreeFuncType
// (torch/csrc/cuda/CUDAPluggableAllocator.h) are exactly the signatures below.
#pragma once

#include <cstddef>
#include <string>

#define FLEXIUM_EXPORT __attribute__((visibility("default")))

extern "C" {

// The runtime's stream type, the same pointer as the driver's CUstream; only passed through.
typedef struct CUstream_st *cudaStream_t;

// Rounds `size` up to the device's granularity and returns the segment's address; NULL on any
// failure, out of memory included. Never throws: flexium_vmm_last_error() says why.
FLEXIUM_EXPORT void *flexium_vmm_alloc(std::size_t size, int device, cudaStream_t stream) noexcept;

// Gives a segment back. PyTorch passes the size it asked for, not the rounded one: the registry
// knows the real size. A pointer it never handed out is ignored and counted.
FLEXIUM_EXPORT void flexium_vmm_free(void *ptr, std::size_t size, int device, cudaStream_t stream) noexcept;

// The text of this thread's last failure of either function ("" if none); valid until its next one.
FLEXIUM_EXPORT const char *flexium_vmm_last_error(void) noexcept;

}  // extern "C"

namespace flexium {

std::string vmm_last_error();

// Opens the pool to the GPUs the process has begun to use since the pool last looked (their
// primary context active): a copy that such a GPU runs into the pool (DataParallel's gather, a
// split model's backward) works without a new segment having been made first. Returns how many.
int open_pool_to_current_users();

}  // namespace flexium
