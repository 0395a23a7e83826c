// One table of every libcuda function flexium calls, resolved once at run time.
// libcuda is never linked: a machine without a driver must still import flexium.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "cuda_driver_types.h"

namespace flexium {

// X(name, minimum CUDA version asked of cuGetProcAddress, required)
// An explicit version matters: a plain dlsym can hand back an old ABI (cuDeviceTotalMem v1).
#define FLEXIUM_DRIVER_FUNCTIONS(X)  \
  X(cuInit, 2000, true)              \
  X(cuGetErrorName, 6000, true)      \
  X(cuGetErrorString, 6000, true)    \
  X(cuDeviceGetCount, 2000, true)    \
  X(cuDeviceGet, 2000, true)         \
  X(cuDeviceGetName, 2000, true)     \
  X(cuDeviceGetUuid, 11040, true)    \
  X(cuDeviceTotalMem, 3020, true)    \
  X(cuDeviceGetPCIBusId, 4010, true) \
  FLEXIUM_CHECKPOINT_FUNCTIONS(X)    \
  FLEXIUM_VMM_FUNCTIONS(X)           \
  FLEXIUM_CHECKSUM_FUNCTIONS(X)

// The process checkpoint API (checkpoint.cpp): every function arrived with CUDA 12.8; all
// optional, without them flexium only trains.
constexpr int kCheckpointApiVersion = 12080;
#define FLEXIUM_CHECKPOINT_FUNCTIONS(X)                                  \
  X(cuCheckpointProcessGetState, kCheckpointApiVersion, false)           \
  X(cuCheckpointProcessGetRestoreThreadId, kCheckpointApiVersion, false) \
  X(cuCheckpointProcessLock, kCheckpointApiVersion, false)               \
  X(cuCheckpointProcessCheckpoint, kCheckpointApiVersion, false)         \
  X(cuCheckpointProcessRestore, kCheckpointApiVersion, false)            \
  X(cuCheckpointProcessUnlock, kCheckpointApiVersion, false)

// The fast path's allocator and relocation (vmm_*.cpp), and the look for memory the checkpoint cannot
// carry (uncheckpointable_memory.cpp). Versions are those of each function's
// current ABI in cudaTypedefs.h (cuDevicePrimaryCtxRelease_v2 11000, cuStreamDestroy_v2 and
// cuEventDestroy_v2 4000, cuMemHostRegister_v2 6050, the 64-bit cuMemcpy*_v2 3020); all
// optional: without them only the driver path is offered.
#define FLEXIUM_VMM_FUNCTIONS(X)                          \
  X(cuCtxGetCurrent, 4000, false)                         \
  X(cuCtxSetCurrent, 4000, false)                         \
  X(cuCtxGetDevice, 2000, false)                          \
  X(cuCtxSynchronize, 2000, false)                        \
  X(cuDevicePrimaryCtxRetain, 7000, false)                \
  X(cuDevicePrimaryCtxRelease, 11000, false)              \
  X(cuDevicePrimaryCtxGetState, 7000, false)              \
  X(cuDeviceCanAccessPeer, 4000, false)                   \
  X(cuMemGetAllocationGranularity, 10020, false)          \
  X(cuMemAddressReserve, 10020, false)                    \
  X(cuMemAddressFree, 10020, false)                       \
  X(cuMemCreate, 10020, false)                            \
  X(cuMemRelease, 10020, false)                           \
  X(cuPointerGetAttribute, 4000, false)                   \
  X(cuMemRetainAllocationHandle, 11000, false)            \
  X(cuMemGetAllocationPropertiesFromHandle, 10020, false) \
  X(cuMemMap, 10020, false)                               \
  X(cuMemUnmap, 10020, false)                             \
  X(cuMemSetAccess, 10020, false)                         \
  X(cuMemExportToShareableHandle, 10020, false)           \
  X(cuMemImportFromShareableHandle, 10020, false)         \
  X(cuMemcpyDtoDAsync, 3020, false)                       \
  X(cuMemcpyDtoHAsync, 3020, false)                       \
  X(cuMemcpyHtoDAsync, 3020, false)                       \
  X(cuMemHostRegister, 6050, false)                       \
  X(cuMemHostUnregister, 4000, false)                     \
  X(cuStreamCreate, 2000, false)                          \
  X(cuStreamSynchronize, 2000, false)                     \
  X(cuStreamDestroy, 4000, false)                         \
  X(cuEventCreate, 2000, false)                           \
  X(cuEventRecord, 2000, false)                           \
  X(cuEventSynchronize, 2000, false)                      \
  X(cuEventDestroy, 4000, false)

// The moves' checksum kernel (move_checksum.cpp), loaded from PTX text: in every driver since CUDA
// 2.x (cuLaunchKernel 4.0); cuLibraryLoadData would need 12.0. Its few sums live in memory of
// cuMemAlloc, set and read by synchronous calls (the 64-bit _v2 ABIs, 3020), apart from the
// moves' own VMM memory and asynchronous copies.
// Optional: without them moves run unchecked, and say so.
#define FLEXIUM_CHECKSUM_FUNCTIONS(X) \
  X(cuModuleLoadData, 2000, false)    \
  X(cuModuleGetFunction, 2000, false) \
  X(cuModuleUnload, 2000, false)      \
  X(cuLaunchKernel, 4000, false)      \
  X(cuMemAlloc, 3020, false)          \
  X(cuMemFree, 3020, false)           \
  X(cuMemsetD8, 3020, false)          \
  X(cuMemcpyDtoH, 3020, false)

struct DriverTable {
  bool loaded = false;          // library opened and every required symbol resolved
  std::string library;          // path or soname that was opened
  std::string load_error;       // why loading failed, empty when loaded
  int cuda_version = 0;         // cuDriverGetVersion, e.g. 13000
  CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;  // cuInit(0)
  std::vector<std::string> missing_optional;          // feature symbols the driver lacks

#define FLEXIUM_DECLARE_POINTER(name, version, required) PFN_##name name = nullptr;
  FLEXIUM_DRIVER_FUNCTIONS(FLEXIUM_DECLARE_POINTER)
#undef FLEXIUM_DECLARE_POINTER
};

// Loads on first use; FLEXIUM_LIBCUDA names another library (the tests' fake driver).
const DriverTable &driver();

// Whether every FLEXIUM_CHECKPOINT_FUNCTIONS symbol resolved (pause, resume and migration can run).
bool has_checkpoint_api();

// Whether every FLEXIUM_VMM_FUNCTIONS symbol resolved (the fast path's allocator can run).
bool has_vmm_api();

// The minimum CUDA version asked for each function, by its name: driver_versions::cuMemMap.
namespace driver_versions {
#define FLEXIUM_DECLARE_VERSION(name, version, required) constexpr int name = version;
FLEXIUM_DRIVER_FUNCTIONS(FLEXIUM_DECLARE_VERSION)
#undef FLEXIUM_DECLARE_VERSION
}  // namespace driver_versions

// Whether every FLEXIUM_CHECKSUM_FUNCTIONS symbol resolved (moves can be checksummed on the GPU).
bool has_checksum_api();

// What Python's driver_status() reports: whether the driver loaded, and which features it has.
struct DriverStatus {
  bool loaded = false;
  std::string library;
  std::optional<std::string> error;       // why loading failed
  int cuda_version = 0;
  std::optional<std::string> init_error;  // cuInit's error name, when it failed
  bool checkpoint_api = false;
  bool vmm_api = false;
  bool checksum_api = false;
  std::vector<std::string> missing_optional;
};
DriverStatus driver_status();

}  // namespace flexium
