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
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;

enum : CUresult {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
  CUDA_ERROR_OPERATING_SYSTEM = 304,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_ILLEGAL_STATE = 401,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_PERMITTED = 800,
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

// Virtual memory management (CUDA 10.2+). Values and layouts as in cuda.h of CUDA 13.0; the
// docs of CUmemAllocationProp_v1, CUmemLocation_v1 and CUmemAccessDesc_v1 list the same members.
typedef enum CUmemAllocationType_enum {
  CU_MEM_ALLOCATION_TYPE_INVALID = 0,
  CU_MEM_ALLOCATION_TYPE_PINNED = 1,
} CUmemAllocationType;

typedef enum CUmemAllocationHandleType_enum {
  CU_MEM_HANDLE_TYPE_NONE = 0,
  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
} CUmemAllocationHandleType;

typedef enum CUmemLocationType_enum {
  CU_MEM_LOCATION_TYPE_INVALID = 0,
  CU_MEM_LOCATION_TYPE_DEVICE = 1,
  CU_MEM_LOCATION_TYPE_HOST = 2,
  CU_MEM_LOCATION_TYPE_HOST_NUMA = 3,
  CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT = 4,
} CUmemLocationType;

typedef enum CUmemAccess_flags_enum {
  CU_MEM_ACCESS_FLAGS_PROT_NONE = 0,
  CU_MEM_ACCESS_FLAGS_PROT_READ = 1,
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
} CUmemAccess_flags;

typedef enum CUmemAllocationGranularity_flags_enum {
  CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
  CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1,
} CUmemAllocationGranularity_flags;

// CUDA 13 turned `id` into a union with a {deviceId, localityDomainId} pair of bytes; same size.
typedef struct CUmemLocation_st {
  CUmemLocationType type;
  int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
  CUmemAllocationType type;
  CUmemAllocationHandleType requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
  CUmemLocation location;
  CUmemAccess_flags flags;
} CUmemAccessDesc;

static_assert(sizeof(CUmemLocation) == 8, "layout of CUmemLocation");
static_assert(sizeof(CUmemAllocationProp) == 32, "layout of CUmemAllocationProp");
static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16, "layout of CUmemAllocationProp");
static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "layout of CUmemAllocationProp");
static_assert(sizeof(CUmemAccessDesc) == 12, "layout of CUmemAccessDesc");

enum : unsigned int {
  CU_MEMHOSTREGISTER_PORTABLE = 0x01,  // pinned for every context, not only the registering one
  CU_STREAM_NON_BLOCKING = 0x1,        // no implicit ordering with the legacy default stream
  CU_EVENT_DISABLE_TIMING = 0x2,       // an event only waited on: cheaper to record
};

typedef CUresult (*PFN_cuGetProcAddress_v2)(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
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

typedef CUresult (*PFN_cuCtxGetCurrent)(CUcontext *pctx);
typedef CUresult (*PFN_cuCtxSetCurrent)(CUcontext ctx);
typedef CUresult (*PFN_cuCtxGetDevice)(CUdevice *device);
typedef CUresult (*PFN_cuCtxSynchronize)(void);
typedef CUresult (*PFN_cuDevicePrimaryCtxRetain)(CUcontext *pctx, CUdevice dev);
typedef CUresult (*PFN_cuDevicePrimaryCtxRelease)(CUdevice dev);
typedef CUresult (*PFN_cuDevicePrimaryCtxGetState)(CUdevice dev, unsigned int *flags, int *active);
typedef CUresult (*PFN_cuDeviceCanAccessPeer)(int *canAccessPeer, CUdevice dev, CUdevice peerDev);
typedef CUresult (*PFN_cuMemGetAllocationGranularity)(size_t *granularity, const CUmemAllocationProp *prop,
                                                      CUmemAllocationGranularity_flags option);
typedef CUresult (*PFN_cuMemAddressReserve)(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                            unsigned long long flags);
typedef CUresult (*PFN_cuMemAddressFree)(CUdeviceptr ptr, size_t size);
typedef CUresult (*PFN_cuMemCreate)(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                    unsigned long long flags);
typedef CUresult (*PFN_cuMemRelease)(CUmemGenericAllocationHandle handle);
enum : int { CU_POINTER_ATTRIBUTE_IS_MANAGED = 8 };  // CUpointer_attribute
typedef CUresult (*PFN_cuPointerGetAttribute)(void *data, int attribute, CUdeviceptr ptr);
typedef CUresult (*PFN_cuMemRetainAllocationHandle)(CUmemGenericAllocationHandle *handle, void *addr);
typedef CUresult (*PFN_cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp *prop,
                                                               CUmemGenericAllocationHandle handle);
typedef CUresult (*PFN_cuMemMap)(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                                 unsigned long long flags);
typedef CUresult (*PFN_cuMemUnmap)(CUdeviceptr ptr, size_t size);
typedef CUresult (*PFN_cuMemSetAccess)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
typedef CUresult (*PFN_cuMemExportToShareableHandle)(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                     CUmemAllocationHandleType handleType, unsigned long long flags);
typedef CUresult (*PFN_cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                       CUmemAllocationHandleType shHandleType);
typedef CUresult (*PFN_cuMemcpyDtoDAsync)(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                          CUstream hStream);
typedef CUresult (*PFN_cuMemcpyDtoHAsync)(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
typedef CUresult (*PFN_cuMemcpyHtoDAsync)(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                          CUstream hStream);
typedef CUresult (*PFN_cuMemHostRegister)(void *p, size_t bytesize, unsigned int Flags);
typedef CUresult (*PFN_cuMemHostUnregister)(void *p);
typedef CUresult (*PFN_cuStreamCreate)(CUstream *phStream, unsigned int Flags);
typedef CUresult (*PFN_cuStreamSynchronize)(CUstream hStream);
typedef CUresult (*PFN_cuStreamDestroy)(CUstream hStream);
typedef CUresult (*PFN_cuEventCreate)(CUevent *phEvent, unsigned int Flags);
typedef CUresult (*PFN_cuEventRecord)(CUevent hEvent, CUstream hStream);
typedef CUresult (*PFN_cuEventSynchronize)(CUevent hEvent);
typedef CUresult (*PFN_cuEventDestroy)(CUevent hEvent);
typedef CUresult (*PFN_cuModuleLoadData)(CUmodule *module, const void *image);
typedef CUresult (*PFN_cuModuleGetFunction)(CUfunction *hfunc, CUmodule hmod, const char *name);
typedef CUresult (*PFN_cuModuleUnload)(CUmodule hmod);
typedef CUresult (*PFN_cuMemAlloc)(CUdeviceptr *dptr, size_t bytesize);
typedef CUresult (*PFN_cuMemFree)(CUdeviceptr dptr);
typedef CUresult (*PFN_cuMemsetD8)(CUdeviceptr dstDevice, unsigned char uc, size_t N);
typedef CUresult (*PFN_cuMemcpyDtoH)(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
typedef CUresult (*PFN_cuLaunchKernel)(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                       unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                       unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                       void **kernelParams, void **extra);

}  // extern "C"
