// The small subset of the CUDA driver API that flexium calls, declared here so that
// building flexium needs no CUDA toolkit. Layouts follow cuda.h of CUDA 13.0 (driver 580);
// every struct is passed zero-initialised, as the driver requires of reserved fields.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t cuuint64_t;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;

enum : CUresult {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_ILLEGAL_STATE = 401,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_TIMEOUT = 909,
  CUDA_ERROR_UNKNOWN = 999,
};

typedef struct CUuuid_st {
  char bytes[16];
} CUuuid;

// cuGetProcAddress_v2 (CUDA 12.0+): flags and the status of the lookup.
enum : cuuint64_t { CU_GET_PROC_ADDRESS_DEFAULT = 0 };
typedef enum CUdriverProcAddressQueryResult_enum {
  CU_GET_PROC_ADDRESS_SUCCESS = 0,
  CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
  CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2,
} CUdriverProcAddressQueryResult;

// Checkpoint API (CUDA 12.8+; GPU remapping on restore needs driver 580+).
typedef enum CUprocessState_enum {
  CU_PROCESS_STATE_RUNNING = 0,
  CU_PROCESS_STATE_LOCKED = 1,
  CU_PROCESS_STATE_CHECKPOINTED = 2,
  CU_PROCESS_STATE_FAILED = 3,
} CUprocessState;

typedef struct CUcheckpointLockArgs_st {
  unsigned int timeoutMs;
  unsigned int reserved0;
  cuuint64_t reserved1[7];
} CUcheckpointLockArgs;

typedef struct CUcheckpointCheckpointArgs_st {
  cuuint64_t reserved[8];
} CUcheckpointCheckpointArgs;

typedef struct CUcheckpointGpuPair_st {
  CUuuid oldUuid;
  CUuuid newUuid;
} CUcheckpointGpuPair;

typedef struct CUcheckpointRestoreArgs_st {
  CUcheckpointGpuPair *gpuPairs;
  unsigned int gpuPairsCount;
  char reserved[44];
  cuuint64_t reserved1;
} CUcheckpointRestoreArgs;

typedef struct CUcheckpointUnlockArgs_st {
  cuuint64_t reserved[8];
} CUcheckpointUnlockArgs;

static_assert(sizeof(CUcheckpointLockArgs) == 64, "layout of CUcheckpointLockArgs");
static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "layout of CUcheckpointRestoreArgs");

typedef CUresult (*PFN_cuGetProcAddress_v2)(const char *symbol, void **pfn, int cudaVersion,
                                            cuuint64_t flags,
                                            CUdriverProcAddressQueryResult *symbolStatus);
typedef CUresult (*PFN_cuInit)(unsigned int flags);
typedef CUresult (*PFN_cuDriverGetVersion)(int *driverVersion);
typedef CUresult (*PFN_cuGetErrorName)(CUresult error, const char **pStr);
typedef CUresult (*PFN_cuGetErrorString)(CUresult error, const char **pStr);
typedef CUresult (*PFN_cuDeviceGetCount)(int *count);
typedef CUresult (*PFN_cuDeviceGet)(CUdevice *device, int ordinal);
typedef CUresult (*PFN_cuDeviceGetName)(char *name, int len, CUdevice dev);
typedef CUresult (*PFN_cuDeviceGetUuid)(CUuuid *uuid, CUdevice dev);
typedef CUresult (*PFN_cuDeviceTotalMem)(size_t *bytes, CUdevice dev);
typedef CUresult (*PFN_cuDeviceGetPCIBusId)(char *pciBusId, int len, CUdevice dev);
typedef CUresult (*PFN_cuCheckpointProcessGetState)(int pid, CUprocessState *state);
typedef CUresult (*PFN_cuCheckpointProcessGetRestoreThreadId)(int pid, int *tid);
typedef CUresult (*PFN_cuCheckpointProcessLock)(int pid, CUcheckpointLockArgs *args);
typedef CUresult (*PFN_cuCheckpointProcessCheckpoint)(int pid, CUcheckpointCheckpointArgs *args);
typedef CUresult (*PFN_cuCheckpointProcessRestore)(int pid, CUcheckpointRestoreArgs *args);
typedef CUresult (*PFN_cuCheckpointProcessUnlock)(int pid, CUcheckpointUnlockArgs *args);

}  // extern "C"
