/*
 * A simulated NVIDIA driver for machines without a GPU: the few libcuda functions flexium
 * resolves (csrc/driver_table.h) and the NVML functions pynvml needs, in one shared library, so
 * that flexium._C (through FLEXIUM_LIBCUDA) and pynvml (through FLEXIUM_LIBNVML) see one machine.
 * Built with the package as libflexium_simulated_driver.so: the tests' fake driver
 * (tests/fake_driver) and the simulated host of `flexium demo` (python/flexium/simulated.py).
 *
 * It models the facts measured on real GPUs (docs/facts.md):
 *  - one CUDA process (getpid()) with a checkpoint state machine
 *      RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED -unlock-> RUNNING;
 *    any other transition is CUDA_ERROR_ILLEGAL_STATE and changes nothing;
 *  - a restore with GPU pairs must name every visible GPU once as old and once as new (fact `restore-pairs-every-gpu`),
 *    and a failed restore leaves the process CHECKPOINTED (fact `failed-restore-stays-checkpointed`);
 *  - after a remap cuDeviceGetUuid names the GPU a device is on now while its PCI bus id stays the
 *    old one (fact `remap-keeps-old-identity`), and NVML reports physical GPUs and where the
 *    process's memory really is (fact `zero-residue`), but for memory the process holds only
 *    through an import of its own export (fact `nvml-skips-imported-memory`);
 *  - while the process is not RUNNING, every other CUDA and NVML call blocks, including on the
 *    thread that took the lock (facts `locked-process-blocks-cuda`, `nvml-reader-process`).
 * Control functions (fake_*) let tests set memory, inject failures and read a call log.
 * See tests/support/fake_driver.py for the full description.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ CUDA driver types */

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t cuuint64_t;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_DEINITIALIZED = 4,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_IMAGE = 200,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_OPERATING_SYSTEM = 304,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_ILLEGAL_STATE = 401,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
  CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
  CUDA_ERROR_LAUNCH_FAILED = 719,
  CUDA_ERROR_NOT_PERMITTED = 800,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803,
  CUDA_ERROR_TIMEOUT = 909,
  CUDA_ERROR_UNKNOWN = 999,
};

typedef struct {
  char bytes[16];
} CUuuid;

enum { CU_GET_PROC_ADDRESS_SUCCESS = 0, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
       CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2 };
/* cuGetProcAddress flags the real driver accepts: default, legacy stream, per-thread stream. */
#define FAKE_PROC_ADDRESS_FLAGS 3ull

enum { CU_PROCESS_STATE_RUNNING = 0, CU_PROCESS_STATE_LOCKED = 1, CU_PROCESS_STATE_CHECKPOINTED = 2,
       CU_PROCESS_STATE_FAILED = 3 };

typedef struct {
  unsigned int timeoutMs;
  unsigned int reserved0;
  cuuint64_t reserved1[7];
} CUcheckpointLockArgs;

typedef struct {
  cuuint64_t reserved[8];
} CUcheckpointCheckpointArgs;

typedef struct {
  CUuuid oldUuid;
  CUuuid newUuid;
} CUcheckpointGpuPair;

/* Everything after gpuPairsCount is reserved and must be zero, whatever later headers call it. */
typedef struct {
  CUcheckpointGpuPair *gpuPairs;
  unsigned int gpuPairsCount;
  char reserved[44];
  cuuint64_t reserved1;
} CUcheckpointRestoreArgs;

typedef struct {
  cuuint64_t reserved[8];
} CUcheckpointUnlockArgs;

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "layout of CUcheckpointLockArgs");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "layout of CUcheckpointRestoreArgs");
_Static_assert(sizeof(CUcheckpointGpuPair) == 32, "layout of CUcheckpointGpuPair");

/* Virtual memory management, as in cuda.h of CUDA 13.0 (csrc/cuda_driver_types.h). */
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;

enum { CU_MEM_ALLOCATION_TYPE_PINNED = 1, CU_MEM_LOCATION_TYPE_DEVICE = 1, CU_MEM_LOCATION_TYPE_HOST_NUMA = 3,
       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1 };

typedef struct {
  int type;
  int id;
} CUmemLocation;

typedef struct {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

typedef struct {
  CUmemLocation location;
  int flags;
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemAllocationProp) == 32, "layout of CUmemAllocationProp");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "layout of CUmemAccessDesc");

/* ------------------------------------------------------------------ NVML types */

typedef int nvmlReturn_t;
enum {
  NVML_SUCCESS = 0,
  NVML_ERROR_UNINITIALIZED = 1,
  NVML_ERROR_INVALID_ARGUMENT = 2,
  NVML_ERROR_NOT_SUPPORTED = 3,
  NVML_ERROR_NO_PERMISSION = 4,
  NVML_ERROR_ALREADY_INITIALIZED = 5,
  NVML_ERROR_NOT_FOUND = 6,
  NVML_ERROR_INSUFFICIENT_SIZE = 7,
  NVML_ERROR_DRIVER_NOT_LOADED = 9,
  NVML_ERROR_TIMEOUT = 10,
  NVML_ERROR_LIBRARY_NOT_FOUND = 12,
  NVML_ERROR_FUNCTION_NOT_FOUND = 13,
  NVML_ERROR_GPU_IS_LOST = 15,
  NVML_ERROR_IN_USE = 19,
  NVML_ERROR_MEMORY = 20,
  NVML_ERROR_NO_DATA = 21,
  NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
  NVML_ERROR_UNKNOWN = 999,
};

typedef struct {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
} nvmlMemory_t;

typedef struct {
  unsigned int version;
  unsigned long long total;
  unsigned long long reserved;
  unsigned long long free;
  unsigned long long used;
} nvmlMemory_v2_t;
#define NVML_MEMORY_V2_VERSION (unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24))

/* nvmlProcessInfo_v2_t; pynvml 13 uses the same layout for the _v3 entry points. */
typedef struct {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
  unsigned int gpu;
  unsigned int memory;
} nvmlUtilization_t;

typedef struct {
  unsigned int version;
  int sensorType;
  int temperature;
} nvmlTemperature_t;
#define NVML_TEMPERATURE_V1_VERSION (unsigned int)(sizeof(nvmlTemperature_t) | (1u << 24))

typedef struct {
  char busIdLegacy[16];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pciDeviceId;
  unsigned int pciSubSystemId;
  char busId[32];
} nvmlPciInfo_t;

_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "layout of nvmlProcessInfo_v2_t");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "layout of nvmlMemory_v2_t");

/* ------------------------------------------------------------------ the modelled machine */

#define MAX_GPUS 16
#define MAX_RULES 64
#define MAX_COUNTERS 128
#define LOG_CAPACITY 4096
#define MAX_DELAYS 32
#define MIB (1024ull * 1024ull)
/* Above the kernel's PID_MAX_LIMIT (2^22), so never a real process. */
#define OTHER_PID_BASE 4195304u

struct gpu {
  CUuuid uuid;
  char uuid_text[48];
  char name[96];
  char pci_bus_id[16]; /* "0000:18:00.0", as cuDeviceGetPCIBusId prints it */
  unsigned int bus;
  unsigned long long total;
  unsigned long long other_bytes; /* used by other processes */
  unsigned int util_gpu, util_memory, temperature_c;
  unsigned long long ecc_uncorrected;
};

struct rule {
  char function[64];
  int countdown; /* fires when it reaches 0; 0 at creation means every call */
  int every;
  int code;
};

struct counter {
  char function[64];
  int count;
};

struct log_entry {
  const char *function;
  int result;
  int pairs;
  long tid;
};

struct delay {
  char function[64];
  unsigned int ms;
};

static pthread_mutex_t mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t state_changed = PTHREAD_COND_INITIALIZER;

static struct {
  /* configuration read from the environment */
  int cuda_version;
  int no_checkpoint;
  int no_vmm;
  int no_checksum; /* FAKE_CUDA_NO_CHECKSUM: a driver without the functions the moves' checksum needs */
  /* FAKE_NVML_RESERVED_MIB: what the driver keeps of each GPU for itself. Not allocatable; NVML's v1
   * memory info counts it as used (615 MiB on an idle H200, driver 580: fact `driver-made-host-memory`),
   * the v2 one as reserved. 0 by default, where the tests' figures were set. */
  unsigned long long reserved_bytes;
  char nvml_driver[80];
  int gpu_count;
  struct gpu gpus[MAX_GPUS];
  /* FAKE_CUDA_HOST_FILE: what other processes hold on each GPU of a simulated host, one
   * "PHYSICAL BYTES" line each, read at each use: every process of the host (a job, its NVML reader
   * process, a neighbour a test starts and ends) sees the same GPUs. */
  char host_file[4096];
  /* FAKE_CUDA_HOST_DIR: where every process of one simulated host says what it holds on each GPU, a
   * file named by its pid of "PHYSICAL BYTES" lines, rewritten when that changes; each process counts
   * the others' (those alive), as NVML shows every process's memory on a real host. Unset, each
   * process sees only itself and what it is told: the tests run simulated jobs side by side apart. */
  char host_dir[4096];
  long published_pid; /* the process that wrote published_text there (0: none since the last reset) */

  /* the process */
  int initialized;       /* cuInit succeeded */
  long restore_tid;      /* thread that ran cuInit: stands for the driver's restore thread */
  int state;
  long lock_tid;         /* thread that took the checkpoint lock */
  int placement[MAX_GPUS];                     /* logical device -> physical GPU */
  unsigned long long process_bytes[MAX_GPUS];  /* per logical device */
  int restore_poisoned;
  int failed_restore_poisons;
  /* Measured on H200s (driver 580): a checkpoint taken while the process held imported VMM memory
   * cannot be restored: the restore, remapped or in place, fails with CUDA_ERROR_NOT_SUPPORTED and
   * the process stays CHECKPOINTED (fact `imported-memory-cannot-ride-checkpoint`). */
  int image_has_imported;
  /* Pinned host bytes when the last checkpoint was taken: on H200s pinned memory slows the
   * checkpoint and restore (fact `pinned-memory-slows-checkpoint`), so the fast pause unpins before it. */
  unsigned long long pinned_at_checkpoint;

  /* behaviour and failure injection */
  int no_peer_access; /* cuDeviceCanAccessPeer says 0 for every pair (GPUs without P2P) */
  unsigned int lock_delay_ms;
  unsigned int block_timeout_ms;
  struct rule rules[MAX_RULES];
  int rule_count;
  /* Copies whose destination gets one bit flipped after the copy (fake_corrupt_copy,
   * FAKE_CUDA_CORRUPT): the fault the moves' checksum must catch. */
  struct rule corruptions[MAX_RULES];
  int corruption_count;
  struct delay delays[MAX_DELAYS];
  int delay_count;

  /* observation */
  struct counter counters[MAX_COUNTERS];
  int counter_count;
  struct log_entry log[LOG_CAPACITY];
  long log_total;
  int last_pairs_count;
  int last_pairs_old[MAX_GPUS * 4];
  int last_pairs_new[MAX_GPUS * 4];
  int blocked_calls;
  int deadlocks;

  int nvml_refcount;
} fake;

static long current_tid(void) { return (long)syscall(SYS_gettid); }

/* Memory other processes hold on a GPU: what this process was told (fake_set_other_memory) and what
 * the host file says. */
static unsigned long long held_in_file(const char *path, int physical) {
  FILE *file = fopen(path, "r");
  if (file == NULL) return 0;
  int index = 0;
  unsigned long long held = 0, bytes = 0;
  while (fscanf(file, "%d %llu", &index, &held) == 2) {
    if (index == physical) bytes += held;
  }
  fclose(file);
  return bytes;
}

/* When process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field), 0 when there is
 * none: a file of the host directory names its writer by pid and start, so a pid used again by another
 * process (after a reboot) is not taken for the writer. */
static unsigned long long start_of(long pid) {
  char path[64], stat[1024];
  snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
  FILE *file = fopen(path, "r");
  if (file == NULL) return 0;
  const size_t n = fread(stat, 1, sizeof(stat) - 1, file);
  fclose(file);
  stat[n] = '\0';
  const char *field = strrchr(stat, ')'); /* the command may hold spaces and parentheses */
  if (field == NULL) return 0;
  unsigned long long start = 0;
  char state = 0;
  /* after ")": state (3rd field), then 4th..21st, then starttime (22nd) */
  if (sscanf(field + 1, " %c %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %llu", &state,
             &start) != 2) {
    return 0;
  }
  return state == 'Z' ? 0 : start; /* a zombie's memory went with its exit */
}

#define MAX_HOLDINGS 4096

static int own_allocation_keys(unsigned long long *keys, int room);

static int key_in(unsigned long long key, const unsigned long long *keys, int n) {
  for (int k = 0; k < n; ++k)
    if (keys[k] == key) return 1;
  return 0;
}

/* The other processes of the host directory that hold memory on a GPU: up to `room` of them, pids and
 * bytes; how many there are. An allocation two processes hold (its maker and an importer) counts once,
 * not at all where it is this process's own. A file whose writer has gone is taken away. */
static int neighbours_on(int physical, unsigned int *pids, unsigned long long *bytes, int room) {
  if (fake.host_dir[0] == '\0') return 0;
  DIR *dir = opendir(fake.host_dir);
  if (dir == NULL) return 0;
  static unsigned long long seen[MAX_HOLDINGS];
  int seen_count = own_allocation_keys(seen, MAX_HOLDINGS);
  int n = 0;
  const long self = (long)getpid();
  struct dirent *entry;
  while ((entry = readdir(dir)) != NULL) {
    char *end = NULL;
    const long pid = strtol(entry->d_name, &end, 10);
    if (pid <= 0 || end == entry->d_name || *end != '\0' || pid == self) continue;
    char path[sizeof(fake.host_dir) + 32];
    snprintf(path, sizeof(path), "%s/%ld", fake.host_dir, pid);
    FILE *file = fopen(path, "r");
    if (file == NULL) continue;
    unsigned long long started = 0;
    const unsigned long long alive_since = start_of(pid);
    if (fscanf(file, "start %llu", &started) != 1 || alive_since != started) {
      fclose(file);
      if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) unlink(path); /* its writer has gone: no one else will */
      else if (alive_since != 0 && started != 0 && alive_since != started) unlink(path); /* a pid used again */
      continue;
    }
    int index = 0;
    unsigned long long held = 0, key = 0, total = 0;
    while (fscanf(file, "%d %llu %llu", &index, &held, &key) == 3) {
      if (index != physical) continue;
      if (key != 0) {
        if (key_in(key, seen, seen_count)) continue;
        if (seen_count < MAX_HOLDINGS) seen[seen_count++] = key;
      }
      total += held;
    }
    fclose(file);
    if (total == 0) continue;
    if (n < room) {
      pids[n] = (unsigned int)pid;
      bytes[n] = total;
    }
    ++n;
  }
  closedir(dir);
  return n;
}

#define MAX_NEIGHBOURS 64

/* Memory other processes hold on a GPU that this process was told of: fake_set_other_memory and
 * the host file. */
static unsigned long long told_on(int physical) {
  const unsigned long long bytes = fake.gpus[physical].other_bytes;
  return fake.host_file[0] != '\0' ? bytes + held_in_file(fake.host_file, physical) : bytes;
}

/* Memory other processes hold on a GPU: what this process was told of, and what the processes of
 * the host directory say they hold. */
static unsigned long long others_on(int physical) {
  unsigned long long bytes = told_on(physical);
  unsigned int pids[MAX_NEIGHBOURS];
  unsigned long long held[MAX_NEIGHBOURS];
  const int n = neighbours_on(physical, pids, held, MAX_NEIGHBOURS);
  for (int k = 0; k < n && k < MAX_NEIGHBOURS; ++k) bytes += held[k];
  return bytes;
}

static void sleep_ms(unsigned int ms) {
  struct timespec ts = {(time_t)(ms / 1000u), (long)(ms % 1000u) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static uint64_t splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static void format_uuid(const CUuuid *uuid, char *out) {
  static const char hex[] = "0123456789abcdef";
  char *p = out;
  memcpy(p, "GPU-", 4);
  p += 4;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) *p++ = '-';
    const unsigned char byte = (unsigned char)uuid->bytes[i];
    *p++ = hex[byte >> 4];
    *p++ = hex[byte & 0xf];
  }
  *p = '\0';
}

static int env_int(const char *name, int fallback) {
  const char *text = getenv(name);
  if (text == NULL || *text == '\0') return fallback;
  char *end = NULL;
  long value = strtol(text, &end, 10);
  return (end != NULL && *end == '\0') ? (int)value : fallback;
}

/* Item `index` of a comma list; a list shorter than the GPU count repeats its last item. */
static void list_item(const char *list, int index, char *out, size_t size) {
  const char *start = list;
  const char *last_start = list;
  for (int i = 0; i <= index; ++i) {
    last_start = start;
    const char *comma = strchr(start, ',');
    if (comma == NULL) {
      start = NULL;
      break;
    }
    if (i == index) break;
    start = comma + 1;
  }
  const char *item = start != NULL ? start : last_start;
  size_t length = strcspn(item, ",");
  if (length >= size) length = size - 1;
  memcpy(out, item, length);
  out[length] = '\0';
}

/* Copies the item of a comma-separated list at `cursor` into `out` (cut to `size`); returns where
 * the next item starts. */
static const char *next_item(const char *cursor, char *out, size_t size) {
  size_t length = strcspn(cursor, ",");
  const char *next = cursor + length;
  if (length >= size) length = size - 1;
  memcpy(out, cursor, length);
  out[length] = '\0';
  return *next == ',' ? next + 1 : next;
}

static int add_rule(const char *function, int nth, int code);
static int add_corruption(const char *function, int nth);
static int add_delay(const char *function, unsigned int ms);

static void configure_from_environment(void) {
  fake.cuda_version = env_int("FAKE_CUDA_VERSION", 13000);
  fake.no_checkpoint = env_int("FAKE_CUDA_NO_CHECKPOINT", 0) != 0;
  fake.no_vmm = env_int("FAKE_CUDA_NO_VMM", 0) != 0;
  fake.no_checksum = env_int("FAKE_CUDA_NO_CHECKSUM", 0) != 0;
  fake.reserved_bytes = (unsigned long long)env_int("FAKE_NVML_RESERVED_MIB", 0) * MIB;
  const char *driver = getenv("FAKE_NVML_DRIVER");
  snprintf(fake.nvml_driver, sizeof(fake.nvml_driver), "%s", driver != NULL && *driver ? driver : "580.159.04");
  const char *host_file = getenv("FAKE_CUDA_HOST_FILE");
  snprintf(fake.host_file, sizeof(fake.host_file), "%s", host_file != NULL ? host_file : "");
  const char *host_dir = getenv("FAKE_CUDA_HOST_DIR");
  snprintf(fake.host_dir, sizeof(fake.host_dir), "%s", host_dir != NULL ? host_dir : "");
  /* Each simulated host (FLEXIUM_SIMULATED_HOST) counts the memory of its own processes only: a folder of
   * its own in FAKE_CUDA_HOST_DIR, named after it ('/' and '.' kept out), made by its first process. */
  const char *simulated_host = getenv("FLEXIUM_SIMULATED_HOST");
  if (fake.host_dir[0] != '\0' && simulated_host != NULL && *simulated_host != '\0') {
    size_t at = strlen(fake.host_dir);
    at += (size_t)snprintf(fake.host_dir + at, sizeof(fake.host_dir) - at, "/host-");
    for (const char *c = simulated_host; *c != '\0' && at + 1 < sizeof(fake.host_dir); ++c) {
      fake.host_dir[at++] = (*c == '/' || *c == '.') ? '_' : *c;
    }
    fake.host_dir[at] = '\0';
    if (mkdir(fake.host_dir, 0700) != 0 && errno != EEXIST) fake.host_dir[0] = '\0';
  }

  int count = env_int("FAKE_CUDA_GPUS", 2);
  if (count < 0) count = 0;
  if (count > MAX_GPUS) count = MAX_GPUS;
  fake.gpu_count = count;
  const char *models = getenv("FAKE_CUDA_MODELS");
  if (models == NULL || *models == '\0') models = "NVIDIA H200";
  const char *totals = getenv("FAKE_CUDA_TOTAL_MIB");
  if (totals == NULL || *totals == '\0') totals = "143771";
  /* A typical 8-GPU HGX board's PCI buses, so bus ids look like the real thing. */
  static const unsigned int buses[8] = {0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb};

  uint64_t seed = 0x466c6578696d2d31ull; /* fixed: the same UUIDs in every run */
  /* FLEXIUM_SIMULATED_HOST: each simulated host has GPUs of its own, their UUIDs drawn from its name
   * (FNV-1a), the same in every run; unset, the GPUs of the one simulated host as before. */
  const char *host = getenv("FLEXIUM_SIMULATED_HOST");
  for (const char *c = host; c != NULL && *c != '\0'; ++c) seed = (seed ^ (unsigned char)*c) * 0x100000001b3ull;
  for (int i = 0; i < MAX_GPUS; ++i) {
    struct gpu *g = &fake.gpus[i];
    memset(g, 0, sizeof(*g));
    const uint64_t hi = splitmix64(&seed);
    const uint64_t lo = splitmix64(&seed);
    memcpy(g->uuid.bytes, &hi, 8);
    memcpy(g->uuid.bytes + 8, &lo, 8);
    format_uuid(&g->uuid, g->uuid_text);
    list_item(models, i, g->name, sizeof(g->name));
    char total_text[32];
    list_item(totals, i, total_text, sizeof(total_text));
    g->total = strtoull(total_text, NULL, 10) * MIB;
    g->bus = i < 8 ? buses[i] : 0xe0u + (unsigned int)i;
    snprintf(g->pci_bus_id, sizeof(g->pci_bus_id), "0000:%02x:00.0", g->bus);
    g->temperature_c = 35;
  }

  /* FAKE_CUDA_FAIL="function:code[:nth],...": failures armed before the library is used, for
   * subprocesses that cannot call fake_fail before flexium._C loads the driver. */
  for (const char *fail = getenv("FAKE_CUDA_FAIL"); fail != NULL && *fail != '\0';) {
    char item[128];
    fail = next_item(fail, item, sizeof(item));
    char *code_text = strchr(item, ':');
    if (code_text != NULL) {
      *code_text++ = '\0';
      char *nth_text = strchr(code_text, ':');
      if (nth_text != NULL) *nth_text++ = '\0';
      add_rule(item, nth_text != NULL ? atoi(nth_text) : 0, atoi(code_text));
    }
  }

  /* FAKE_CUDA_CORRUPT="function:nth,...": corruptions armed the same way (the copier process's copies). */
  for (const char *corrupt = getenv("FAKE_CUDA_CORRUPT"); corrupt != NULL && *corrupt != '\0';) {
    char item[128];
    corrupt = next_item(corrupt, item, sizeof(item));
    char *nth_text = strchr(item, ':');
    if (nth_text != NULL) {
      *nth_text++ = '\0';
      add_corruption(item, atoi(nth_text));
    }
  }

  /* FAKE_CUDA_DELAY="function:ms,...": slow calls armed the same way (a copier process pinning a
   * staging ahead slowly enough for a pause to come while it is half way). */
  for (const char *delay = getenv("FAKE_CUDA_DELAY"); delay != NULL && *delay != '\0';) {
    char item[128];
    delay = next_item(delay, item, sizeof(item));
    char *ms_text = strchr(item, ':');
    if (ms_text != NULL) {
      *ms_text++ = '\0';
      add_delay(item, (unsigned int)strtoul(ms_text, NULL, 10));
    }
  }
}

static void publish_holdings(void);
static void start_publishing(void);

static void reset_locked(void) {
  const int refcount = fake.nvml_refcount;
  const int initialized = fake.initialized;
  const long restore_tid = fake.restore_tid;
  memset(&fake, 0, sizeof(fake));
  /* NVML users (pynvml) and cuInit's effect outlive a reset, as they would a test boundary. */
  fake.nvml_refcount = refcount;
  fake.initialized = initialized;
  fake.restore_tid = restore_tid;
  fake.state = CU_PROCESS_STATE_RUNNING;
  fake.last_pairs_count = -1;
  fake.block_timeout_ms = 5000;
  /* A restore that failed for memory leaves the process unrestorable, as on driver 580
   * (fact `restore-without-room-loses-process`). */
  fake.failed_restore_poisons = 1;
  configure_from_environment();
  for (int i = 0; i < MAX_GPUS; ++i) fake.placement[i] = i;
  publish_holdings();
  start_publishing();
  pthread_cond_broadcast(&state_changed);
}

__attribute__((constructor)) static void fake_load(void) {
  pthread_mutex_lock(&mutex);
  reset_locked();
  pthread_mutex_unlock(&mutex);
}

/* ------------------------------------------------------------------ call bookkeeping */

static struct counter *counter_for(const char *function, int create) {
  for (int i = 0; i < fake.counter_count; ++i) {
    if (strcmp(fake.counters[i].function, function) == 0) return &fake.counters[i];
  }
  if (!create || fake.counter_count == MAX_COUNTERS) return NULL;
  struct counter *c = &fake.counters[fake.counter_count++];
  snprintf(c->function, sizeof(c->function), "%s", function);
  return c;
}

static int add_rule(const char *function, int nth, int code) {
  if (function == NULL || *function == '\0' || nth < 0 || fake.rule_count == MAX_RULES) return -1;
  struct rule *r = &fake.rules[fake.rule_count++];
  snprintf(r->function, sizeof(r->function), "%s", function);
  r->every = nth == 0;
  r->countdown = nth;
  r->code = code;
  return 0;
}

/* Each rule counts the calls of its function on its own; the first one due fires. */
static int injected_failure(const char *function, int *code) {
  int fired = 0;
  int kept = 0;
  for (int i = 0; i < fake.rule_count; ++i) {
    struct rule r = fake.rules[i];
    if (strcmp(r.function, function) == 0) {
      if (r.every) {
        if (!fired) {
          fired = 1;
          *code = r.code;
        }
      } else if (--r.countdown == 0) {
        if (!fired) {
          fired = 1;
          *code = r.code;
        }
        continue; /* used up */
      }
    }
    fake.rules[kept++] = r;
  }
  fake.rule_count = kept;
  return fired;
}

/* The nth next call of a copy function (counted from now, 1 is the next) corrupts what it wrote. */
static int add_corruption(const char *function, int nth) {
  if (function == NULL || *function == '\0' || nth < 1 || fake.corruption_count == MAX_RULES) return -1;
  struct rule *r = &fake.corruptions[fake.corruption_count++];
  snprintf(r->function, sizeof(r->function), "%s", function);
  r->countdown = nth;
  return 0;
}

/* After a copy of `function` wrote `size` bytes at `destination`: flips the lowest bit of its first
 * byte when a corruption is due, as a bad link or memory would. */
static void corrupt_if_due(const char *function, void *destination, size_t size) {
  int kept = 0, due = 0;
  for (int i = 0; i < fake.corruption_count; ++i) {
    struct rule r = fake.corruptions[i];
    if (strcmp(r.function, function) == 0 && --r.countdown == 0) {
      due = 1;
      continue;
    }
    fake.corruptions[kept++] = r;
  }
  fake.corruption_count = kept;
  if (due && size > 0) ((unsigned char *)destination)[0] ^= 1u;
}

static unsigned int delay_for(const char *function) {
  for (int i = 0; i < fake.delay_count; ++i) {
    if (strcmp(fake.delays[i].function, function) == 0) return fake.delays[i].ms;
  }
  return 0;
}

/* Takes the mutex (held until leave()), counts the call, applies a configured delay, and says
 * whether an injected failure replaces the call. */
static int enter(const char *function, int *code) {
  pthread_mutex_lock(&mutex);
  struct counter *c = counter_for(function, 1);
  if (c != NULL) ++c->count;
  const unsigned int ms = delay_for(function);
  if (ms > 0) {
    pthread_mutex_unlock(&mutex);
    sleep_ms(ms);
    pthread_mutex_lock(&mutex);
  }
  return injected_failure(function, code);
}

/* The calls after which what this process holds on a GPU may have changed. */
static int changes_holdings(const char *function) {
  if (strncmp(function, "cuMem", 5) == 0)
    return strncmp(function, "cuMemcpy", 8) != 0 && strncmp(function, "cuMemset", 8) != 0 &&
           strncmp(function, "cuMemGet", 8) != 0 && strncmp(function, "cuMemHost", 9) != 0;
  return strncmp(function, "cuCheckpoint", 12) == 0;
}

static void holdings_path(long pid, const char *suffix, char *path, size_t length) {
  snprintf(path, length, "%s/%ld%s", fake.host_dir, pid, suffix);
}

static unsigned long long process_bytes_on(int physical);

/* A process that ends holds nothing: its file goes (not a forked child's of its parent's file). */
__attribute__((destructor)) static void fake_unload(void) {
  if (fake.host_dir[0] == '\0' || fake.published_pid != (long)getpid()) return;
  char path[sizeof(fake.host_dir) + 32];
  holdings_path(fake.published_pid, "", path, sizeof(path));
  unlink(path);
}

static int leave(const char *function, int result, int pairs) {
  if (changes_holdings(function)) publish_holdings();
  if (strncmp(function, "cu", 2) == 0) {
    struct log_entry *e = &fake.log[fake.log_total % LOG_CAPACITY];
    e->function = function;
    e->result = result;
    e->pairs = pairs;
    e->tid = current_tid();
    ++fake.log_total;
  }
  pthread_mutex_unlock(&mutex);
  return result;
}

/* fact `locked-process-blocks-cuda`: while the process is locked or checkpointed, its other CUDA calls block until
 * it is RUNNING again. On the thread that holds the lock that never happens: the real driver hangs;
 * the fake fails the call at once (and says so on stderr) so a test sees the bug instead of
 * hanging. Called with the mutex held. */
static CUresult wait_until_running(const char *function) {
  if (fake.state == CU_PROCESS_STATE_RUNNING) return CUDA_SUCCESS;
  ++fake.blocked_calls;
  if (current_tid() == fake.lock_tid) {
    ++fake.deadlocks;
    fprintf(stderr, "fake_cuda: %s called by the thread holding the checkpoint lock: "
                    "the real driver hangs here forever (fact `locked-process-blocks-cuda`)\n", function);
    return CUDA_ERROR_ILLEGAL_STATE;
  }
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += fake.block_timeout_ms / 1000u;
  deadline.tv_nsec += (long)(fake.block_timeout_ms % 1000u) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec += 1;
    deadline.tv_nsec -= 1000000000L;
  }
  while (fake.state != CU_PROCESS_STATE_RUNNING) {
    if (pthread_cond_timedwait(&state_changed, &mutex, &deadline) == ETIMEDOUT &&
        fake.state != CU_PROCESS_STATE_RUNNING) {
      ++fake.deadlocks;
      fprintf(stderr, "fake_cuda: %s blocked %u ms while the process was not RUNNING: "
                      "the real driver would still be waiting (fact `locked-process-blocks-cuda`)\n",
              function, fake.block_timeout_ms);
      return CUDA_ERROR_ILLEGAL_STATE;
    }
  }
  return CUDA_SUCCESS;
}

/* A device call: needs cuInit and a running process. */
static CUresult device_call_ready(const char *function) {
  const CUresult blocked = wait_until_running(function);
  if (blocked != CUDA_SUCCESS) return blocked;
  return fake.initialized ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

static void set_state(int state) {
  fake.state = state;
  if (state == CU_PROCESS_STATE_RUNNING) fake.lock_tid = 0;
  pthread_cond_broadcast(&state_changed);
}

static int all_zero(const void *bytes, size_t size) {
  const unsigned char *p = (const unsigned char *)bytes;
  for (size_t i = 0; i < size; ++i) {
    if (p[i] != 0) return 0;
  }
  return 1;
}

static int physical_by_uuid(const CUuuid *uuid) {
  for (int i = 0; i < fake.gpu_count; ++i) {
    if (memcmp(fake.gpus[i].uuid.bytes, uuid->bytes, 16) == 0) return i;
  }
  return -1;
}

/* ------------------------------------------------------------------ VMM memory (state) */

#define HOST_MEMFD_NAME "fake_cuda_vmm_host"
#define GPU_MEMFD_PREFIX "fake_cuda_vmm_gpu"

/* Memory made by cuMemCreate is a memfd of its size living on one physical GPU; a reservation is
 * a PROT_NONE range of host address space; cuMemMap maps the memfd there (MAP_SHARED|MAP_FIXED),
 * with no access until cuMemSetAccess; an exported handle is a dup of the memfd. So the bytes
 * behind a device address are readable from the test with ctypes once access is granted.
 * An allocation lives while a handle, a mapping or an exported fd refers to it (cuMemRelease
 * docs: "including its shareable counterparts"); the fd part is found by scanning
 * /proc/self/fd for the memfd's inode. This state survives fake_reset(), as the process's own
 * objects would: tests free what they allocate. */
#define MAX_VMM 1024
#define VMM_GRANULARITY (2ull * MIB) /* what H100/H200 report, minimum and recommended */

struct vmm_alloc {
  int used;
  int fd; /* the driver's own reference */
  dev_t st_dev;
  ino_t st_ino;
  size_t size;
  int physical;      /* GPU holding the bytes; -1: host memory (its NUMA node is location_id) */
  int riding;        /* logical device it rides the checkpoint with; -1: not in the image */
  int exportable;    /* created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
  int handles;
  int mappings;
  /* Imported from an fd another process exported. Its bytes count for that process while this one only
   * has a handle (the copier's import of the job's segments), and for this one once it maps them (the
   * job's import of the memory the copier made at a resume, which the copier lets go of). */
  int foreign;
  /* Reached again only through an import of its own export (a fast move's target memory, its handle
   * dropped before the checkpoint): on the GPU, but NVML does not count it for the process (fact
   * `nvml-skips-imported-memory`). */
  int imported;
  int location_type; /* as cuMemCreate was asked */
  int location_id;
};

struct vmm_handle {
  int used;
  unsigned long long value;
  int alloc;
  int imported;  /* made by cuMemImportFromShareableHandle */
};

struct vmm_range {
  int used;
  uintptr_t base;
  size_t size;
  int alloc;             /* mappings only */
  unsigned int readers;  /* mappings only: bit per logical device */
  unsigned int writers;
};

struct host_block {
  int used;
  void *ptr;
  size_t size;
};

/* Managed (UVM) memory, cuMemAllocManaged: a shared mapping of a memfd, as the real driver's is of
 * /dev/nvidia-uvm. The checkpoint refuses a process holding any (fact `managed-memory-refused`). */
struct managed_block {
  int used;
  uintptr_t base;
  size_t size;
};

/* Device memory of cuMemAlloc (the checksum's few sums): host memory readable and writable by the
 * device whose context allocated it. Not counted in any GPU's memory: a few bytes. */
#define MAX_PLAIN 64
struct plain_block {
  int used;
  uintptr_t base;
  size_t size;
  int device;
};

struct fake_stream {
  struct fake_stream *next;
  int device;
};

struct fake_event {
  struct fake_event *next;
};

static struct {
  struct vmm_alloc allocs[MAX_VMM];
  struct vmm_handle handles[MAX_VMM];
  struct vmm_range reservations[MAX_VMM];
  struct vmm_range mappings[MAX_VMM];
  struct host_block host[MAX_VMM];
  struct managed_block managed[MAX_VMM];
  struct plain_block plain[MAX_PLAIN];
  struct fake_stream *streams;
  int stream_count;
  struct fake_event *events;
  int event_count;
  unsigned long long next_handle;
  int primary_refs[MAX_GPUS];
} vmm;

/* Primary contexts: one token per device; the thread's current context is an index (-1: none). */
static char primary_tokens[MAX_GPUS];
static __thread int current_context = -1;

static int fd_refers_to(int fd, const struct vmm_alloc *a) {
  struct stat st;
  return fstat(fd, &st) == 0 && st.st_dev == a->st_dev && st.st_ino == a->st_ino;
}

/* Whether any fd of the process but the driver's own still refers to the allocation. */
static int exported_fd_alive(const struct vmm_alloc *a) {
  DIR *dir = opendir("/proc/self/fd");
  if (dir == NULL) return 1; /* cannot tell: keep it */
  int alive = 0;
  struct dirent *entry;
  while (!alive && (entry = readdir(dir)) != NULL) {
    if (entry->d_name[0] == '.') continue;
    const int fd = atoi(entry->d_name);
    if (fd != a->fd && fd != dirfd(dir) && fd_refers_to(fd, a)) alive = 1;
  }
  closedir(dir);
  return alive;
}

static void vmm_collect(void) {
  for (int i = 0; i < MAX_VMM; ++i) {
    struct vmm_alloc *a = &vmm.allocs[i];
    if (!a->used || a->handles > 0 || a->mappings > 0 || exported_fd_alive(a)) continue;
    close(a->fd);
    memset(a, 0, sizeof(*a));
  }
}

static int in_process(const struct vmm_alloc *a) { return a->handles > 0 || a->mappings > 0; }

/* Bytes of VMM memory on a physical GPU now: while checkpointed, what rides the checkpoint image
 * is off the GPUs; memory held only by exported fds stays where it is (fact `exported-fd-survives-checkpoint`). */
static unsigned long long vmm_bytes_on(int physical, int fd_only) {
  unsigned long long bytes = 0;
  for (int i = 0; i < MAX_VMM; ++i) {
    const struct vmm_alloc *a = &vmm.allocs[i];
    if (!a->used || a->physical != physical || (a->foreign && a->mappings == 0)) continue;
    if (fd_only && in_process(a)) continue;
    if (fake.state == CU_PROCESS_STATE_CHECKPOINTED && a->riding >= 0) continue;
    bytes += a->size;
  }
  return bytes;
}

static unsigned long long process_bytes_on(int physical) {
  vmm_collect();
  unsigned long long bytes = vmm_bytes_on(physical, 0);
  if (fake.state == CU_PROCESS_STATE_CHECKPOINTED) return bytes;
  for (int l = 0; l < fake.gpu_count; ++l) {
    if (fake.placement[l] == physical) bytes += fake.process_bytes[l];
  }
  return bytes;
}

/* The keys (files' inodes) of the allocations this process holds: what another process of the host
 * directory says it holds of them is counted here already. */
static int own_allocation_keys(unsigned long long *keys, int room) {
  int n = 0;
  for (int i = 0; i < MAX_VMM && n < room; ++i) {
    if (vmm.allocs[i].used) keys[n++] = (unsigned long long)vmm.allocs[i].st_ino;
  }
  return n;
}

/* Says in the host directory what this process holds on each GPU now, when that changed: "start
 * TICKS", then a line "PHYSICAL BYTES KEY" per allocation (KEY: its file's inode, which every process
 * holding it shares) and one for the memory it was told it holds (KEY 0). A process that holds nothing
 * has no file there. Called with the mutex held. */
static void publish_holdings(void) {
  if (fake.host_dir[0] == '\0') return;
  static char text[MAX_HOLDINGS * 48 + 64], published_text[sizeof(text)];
  const long self = (long)getpid();
  size_t length = (size_t)snprintf(text, sizeof(text), "start %llu\n", start_of(self));
  const size_t header = length;
  vmm_collect();
  for (int i = 0; i < MAX_VMM && length < sizeof(text) - 64; ++i) {
    const struct vmm_alloc *a = &vmm.allocs[i];
    if (!a->used || a->physical < 0 || (a->foreign && a->mappings == 0)) continue;
    if (fake.state == CU_PROCESS_STATE_CHECKPOINTED && a->riding >= 0) continue;
    length += (size_t)snprintf(text + length, sizeof(text) - length, "%d %llu %llu\n", a->physical,
                               (unsigned long long)a->size, (unsigned long long)a->st_ino);
  }
  for (int p = 0; p < fake.gpu_count && fake.state != CU_PROCESS_STATE_CHECKPOINTED; ++p) {
    unsigned long long told = 0;
    for (int l = 0; l < fake.gpu_count; ++l)
      if (fake.placement[l] == p) told += fake.process_bytes[l];
    if (told > 0) length += (size_t)snprintf(text + length, sizeof(text) - length, "%d %llu 0\n", p, told);
  }
  if (fake.published_pid == self && strcmp(text, published_text) == 0) return;
  char path[sizeof(fake.host_dir) + 32], staged[sizeof(fake.host_dir) + 32];
  holdings_path(self, "", path, sizeof(path));
  if (length > header) {
    holdings_path(self, ".tmp", staged, sizeof(staged));
    FILE *file = fopen(staged, "w");
    if (file == NULL) return; /* tried again at the next change */
    fputs(text, file);
    if (fclose(file) != 0 || rename(staged, path) != 0) return;
  } else if (unlink(path) != 0 && errno != ENOENT) {
    return;
  }
  memcpy(published_text, text, length + 1);
  fake.published_pid = self;
}

/* Memory can leave this process with no driver call (an exported fd it closes once another process has
 * it): with a host directory, what it holds is said again a few times a second as well. */
static void *publish_now_and_then(void *unused) {
  (void)unused;
  for (;;) {
    sleep_ms(200);
    pthread_mutex_lock(&mutex);
    publish_holdings();
    pthread_mutex_unlock(&mutex);
  }
  return NULL;
}

static void lock_for_fork(void) { pthread_mutex_lock(&mutex); }
static void unlock_after_fork(void) { pthread_mutex_unlock(&mutex); }

static void start_publishing(void) {
  static int started;
  if (started || fake.host_dir[0] == '\0') return;
  /* A fork while the publisher holds the mutex would leave the child's copy of it locked for good. */
  pthread_atfork(lock_for_fork, unlock_after_fork, unlock_after_fork);
  pthread_t thread;
  if (pthread_create(&thread, NULL, publish_now_and_then, NULL) == 0) {
    pthread_detach(thread);
    started = 1;
  }
}

/* What NVML counts for the process on a GPU: all of process_bytes_on() but the memory it holds only
 * through an import, of its own export or of another process's, which still takes room there (fact
 * `nvml-skips-imported-memory`; for another process's, assumed alike: not measured). */
static unsigned long long nvml_process_bytes_on(int physical) {
  unsigned long long bytes = process_bytes_on(physical);
  for (int i = 0; i < MAX_VMM; ++i) {
    const struct vmm_alloc *a = &vmm.allocs[i];
    if (!a->used || a->physical != physical) continue;
    if (a->foreign ? a->mappings == 0 : !a->imported) continue;
    if (fake.state == CU_PROCESS_STATE_CHECKPOINTED && a->riding >= 0) continue;
    bytes -= a->size;
  }
  return bytes;
}

/* At checkpoint: what the process holds a handle or mapping of goes into the image with the
 * logical device on that GPU; what only an fd holds is skipped. */
static void vmm_checkpoint(void) {
  for (int i = 0; i < MAX_VMM; ++i) {
    struct vmm_alloc *a = &vmm.allocs[i];
    if (!a->used) continue;
    a->riding = -1;
    if (!in_process(a)) continue;
    for (int l = 0; l < fake.gpu_count; ++l) {
      if (fake.placement[l] == a->physical) a->riding = l;
    }
  }
}

static unsigned long long vmm_riding_bytes_to(int physical, const int target[MAX_GPUS]) {
  unsigned long long bytes = 0;
  for (int i = 0; i < MAX_VMM; ++i) {
    const struct vmm_alloc *a = &vmm.allocs[i];
    if (a->used && a->riding >= 0 && target[a->riding] == physical) bytes += a->size;
  }
  return bytes;
}

static void vmm_restored(const int target[MAX_GPUS]) {
  for (int i = 0; i < MAX_VMM; ++i) {
    struct vmm_alloc *a = &vmm.allocs[i];
    if (!a->used || a->riding < 0) continue;
    a->physical = target[a->riding];
    a->riding = -1;
    a->exportable = 0; /* the restored allocation refuses export (fact `restored-memory-unexportable`) */
  }
}

/* ------------------------------------------------------------------ errors */

struct error_text {
  int code;
  const char *name;
  const char *text;
};

static const struct error_text cuda_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM",
     "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE",
     "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
     "system has unsupported display driver / cuda driver combination"},
    {CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "timeout occurred"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static const struct error_text *find_cuda_error(CUresult code) {
  for (size_t i = 0; i < sizeof(cuda_errors) / sizeof(cuda_errors[0]); ++i) {
    if (cuda_errors[i].code == code) return &cuda_errors[i];
  }
  return NULL;
}

/* ------------------------------------------------------------------ libcuda: lookup */

CUresult cuInit(unsigned int flags);
CUresult cuDriverGetVersion(int *driverVersion);
CUresult cuGetErrorName(CUresult error, const char **pStr);
CUresult cuGetErrorString(CUresult error, const char **pStr);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
CUresult cuDeviceTotalMem(size_t *bytes, CUdevice dev);
CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev);
CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev);
CUresult cuCheckpointProcessGetState(int pid, int *state);
CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid);
CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args);
CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args);
CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args);
CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags, int *symbolStatus);
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUresult cuCtxGetCurrent(CUcontext *pctx);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetDevice(CUdevice *device);
CUresult cuCtxSynchronize(void);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease(CUdevice dev);
CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active);
CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option);
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr);
CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
CUresult cuMemFree(CUdeviceptr dptr);
CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle);
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle, int handleType,
                                      unsigned long long flags);
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle, int shHandleType);
CUresult cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
CUresult cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
CUresult cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream);
CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags);
CUresult cuMemHostUnregister(void *p);
CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags);
CUresult cuStreamSynchronize(CUstream hStream);
CUresult cuStreamDestroy(CUstream hStream);
CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
CUresult cuEventRecord(CUevent hEvent, CUstream hStream);
CUresult cuEventSynchronize(CUevent hEvent);
CUresult cuEventDestroy(CUevent hEvent);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
CUresult cuModuleUnload(CUmodule hmod);
CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                        unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra);
CUresult cuMemAlloc(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemsetD8(CUdeviceptr dstDevice, unsigned char uc, size_t N);
CUresult cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);

/* Feature groups a driver may lack: FAKE_CUDA_NO_CHECKPOINT / FAKE_CUDA_NO_VMM hide them. */
enum { FEATURE_BASE = 0, FEATURE_CHECKPOINT = 1, FEATURE_VMM = 2, FEATURE_CHECKSUM = 3 };

struct symbol {
  const char *name;
  int since;    /* CUDA version that introduced this ABI of the function */
  int feature;
  void *fn;
};

/* Only the current ABI of each function exists here: asking for an older one (cuDeviceTotalMem
 * before 3.2 had 32-bit sizes) is VERSION_NOT_SUFFICIENT instead of a wrong-ABI pointer. */
static const struct symbol symbols[] = {
    {"cuInit", 2000, 0, (void *)cuInit},
    {"cuDriverGetVersion", 2020, 0, (void *)cuDriverGetVersion},
    {"cuGetErrorName", 6000, 0, (void *)cuGetErrorName},
    {"cuGetErrorString", 6000, 0, (void *)cuGetErrorString},
    {"cuGetProcAddress", 12000, 0, (void *)cuGetProcAddress_v2},
    {"cuDeviceGetCount", 2000, 0, (void *)cuDeviceGetCount},
    {"cuDeviceGet", 2000, 0, (void *)cuDeviceGet},
    {"cuDeviceGetName", 2000, 0, (void *)cuDeviceGetName},
    {"cuDeviceGetUuid", 9020, 0, (void *)cuDeviceGetUuid},
    {"cuDeviceTotalMem", 3020, 0, (void *)cuDeviceTotalMem},
    {"cuDeviceCanAccessPeer", 4000, FEATURE_VMM, (void *)cuDeviceCanAccessPeer},
    {"cuDeviceGetPCIBusId", 4010, 0, (void *)cuDeviceGetPCIBusId},
    {"cuCheckpointProcessGetState", 12080, 1, (void *)cuCheckpointProcessGetState},
    {"cuCheckpointProcessGetRestoreThreadId", 12080, 1, (void *)cuCheckpointProcessGetRestoreThreadId},
    {"cuCheckpointProcessLock", 12080, 1, (void *)cuCheckpointProcessLock},
    {"cuCheckpointProcessCheckpoint", 12080, 1, (void *)cuCheckpointProcessCheckpoint},
    {"cuCheckpointProcessRestore", 12080, 1, (void *)cuCheckpointProcessRestore},
    {"cuCheckpointProcessUnlock", 12080, 1, (void *)cuCheckpointProcessUnlock},
    /* Versions of the current ABIs, as cudaTypedefs.h names them (cuDevicePrimaryCtxRelease_v11000,
     * cuStreamDestroy_v4000, cuMemcpyDtoDAsync_v3020, cuMemCreate_v10020...). */
    {"cuCtxGetCurrent", 4000, FEATURE_VMM, (void *)cuCtxGetCurrent},
    {"cuCtxSetCurrent", 4000, FEATURE_VMM, (void *)cuCtxSetCurrent},
    {"cuCtxGetDevice", 2000, FEATURE_VMM, (void *)cuCtxGetDevice},
    {"cuCtxSynchronize", 2000, FEATURE_VMM, (void *)cuCtxSynchronize},
    {"cuDevicePrimaryCtxRetain", 7000, FEATURE_VMM, (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", 11000, FEATURE_VMM, (void *)cuDevicePrimaryCtxRelease},
    {"cuDevicePrimaryCtxGetState", 7000, FEATURE_VMM, (void *)cuDevicePrimaryCtxGetState},
    {"cuMemGetAllocationGranularity", 10020, FEATURE_VMM, (void *)cuMemGetAllocationGranularity},
    {"cuMemAddressReserve", 10020, FEATURE_VMM, (void *)cuMemAddressReserve},
    {"cuMemAddressFree", 10020, FEATURE_VMM, (void *)cuMemAddressFree},
    {"cuMemCreate", 10020, FEATURE_VMM, (void *)cuMemCreate},
    {"cuMemRelease", 10020, FEATURE_VMM, (void *)cuMemRelease},
    {"cuMemRetainAllocationHandle", 11000, FEATURE_VMM, (void *)cuMemRetainAllocationHandle},
    {"cuPointerGetAttribute", 4000, FEATURE_VMM, (void *)cuPointerGetAttribute},
    {"cuMemAllocManaged", 6000, FEATURE_VMM, (void *)cuMemAllocManaged},
    {"cuMemFree", 3020, FEATURE_CHECKSUM, (void *)cuMemFree},
    {"cuMemGetAllocationPropertiesFromHandle", 10020, FEATURE_VMM, (void *)cuMemGetAllocationPropertiesFromHandle},
    {"cuMemMap", 10020, FEATURE_VMM, (void *)cuMemMap},
    {"cuMemUnmap", 10020, FEATURE_VMM, (void *)cuMemUnmap},
    {"cuMemSetAccess", 10020, FEATURE_VMM, (void *)cuMemSetAccess},
    {"cuMemExportToShareableHandle", 10020, FEATURE_VMM, (void *)cuMemExportToShareableHandle},
    {"cuMemImportFromShareableHandle", 10020, FEATURE_VMM, (void *)cuMemImportFromShareableHandle},
    {"cuMemcpyDtoDAsync", 3020, FEATURE_VMM, (void *)cuMemcpyDtoDAsync},
    {"cuMemcpyDtoHAsync", 3020, FEATURE_VMM, (void *)cuMemcpyDtoHAsync},
    {"cuMemcpyHtoDAsync", 3020, FEATURE_VMM, (void *)cuMemcpyHtoDAsync},
    {"cuMemHostRegister", 6050, FEATURE_VMM, (void *)cuMemHostRegister},
    {"cuMemHostUnregister", 4000, FEATURE_VMM, (void *)cuMemHostUnregister},
    {"cuStreamCreate", 2000, FEATURE_VMM, (void *)cuStreamCreate},
    {"cuStreamSynchronize", 2000, FEATURE_VMM, (void *)cuStreamSynchronize},
    {"cuStreamDestroy", 4000, FEATURE_VMM, (void *)cuStreamDestroy},
    {"cuEventCreate", 2000, FEATURE_VMM, (void *)cuEventCreate},
    {"cuEventRecord", 2000, FEATURE_VMM, (void *)cuEventRecord},
    {"cuEventSynchronize", 2000, FEATURE_VMM, (void *)cuEventSynchronize},
    {"cuEventDestroy", 4000, FEATURE_VMM, (void *)cuEventDestroy},
    {"cuModuleLoadData", 2000, FEATURE_CHECKSUM, (void *)cuModuleLoadData},
    {"cuModuleGetFunction", 2000, FEATURE_CHECKSUM, (void *)cuModuleGetFunction},
    {"cuModuleUnload", 2000, FEATURE_CHECKSUM, (void *)cuModuleUnload},
    {"cuLaunchKernel", 4000, FEATURE_CHECKSUM, (void *)cuLaunchKernel},
    {"cuMemAlloc", 3020, FEATURE_CHECKSUM, (void *)cuMemAlloc},
    {"cuMemsetD8", 3020, FEATURE_CHECKSUM, (void *)cuMemsetD8},
    {"cuMemcpyDtoH", 3020, FEATURE_CHECKSUM, (void *)cuMemcpyDtoH},
};

static CUresult lookup(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags, int *status) {
  if (symbol == NULL || pfn == NULL || (flags & ~FAKE_PROC_ADDRESS_FLAGS) != 0) return CUDA_ERROR_INVALID_VALUE;
  *pfn = NULL;
  for (size_t i = 0; i < sizeof(symbols) / sizeof(symbols[0]); ++i) {
    const struct symbol *s = &symbols[i];
    if (strcmp(s->name, symbol) != 0) continue;
    /* A driver older than the function, or one built without the checkpoint API, lacks it. */
    if (s->since > fake.cuda_version || (s->feature == FEATURE_CHECKPOINT && fake.no_checkpoint) ||
        (s->feature == FEATURE_VMM && fake.no_vmm) || (s->feature == FEATURE_CHECKSUM && fake.no_checksum)) {
      break;
    }
    if (cudaVersion < s->since) {
      if (status != NULL) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = s->fn;
    if (status != NULL) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
  }
  if (status != NULL) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             int *symbolStatus) {
  static const char fn[] = "cuGetProcAddress_v2";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  return leave(fn, lookup(symbol, pfn, cudaVersion, flags, symbolStatus), -1);
}

/* The legacy entry point (4 arguments, no status), exported under its historical name. */
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
  static const char fn[] = "cuGetProcAddress";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  return leave(fn, lookup(symbol, pfn, cudaVersion, flags, NULL), -1);
}

CUresult cuDriverGetVersion(int *driverVersion) {
  static const char fn[] = "cuDriverGetVersion";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (driverVersion == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  *driverVersion = fake.cuda_version;
  return leave(fn, CUDA_SUCCESS, -1);
}

/* Pure table lookups: they touch no context, so they do not block while the process is locked. */
CUresult cuGetErrorName(CUresult error, const char **pStr) {
  static const char fn[] = "cuGetErrorName";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (pStr == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  const struct error_text *e = find_cuda_error(error);
  *pStr = e != NULL ? e->name : NULL;
  return leave(fn, e != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE, -1);
}

CUresult cuGetErrorString(CUresult error, const char **pStr) {
  static const char fn[] = "cuGetErrorString";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (pStr == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  const struct error_text *e = find_cuda_error(error);
  *pStr = e != NULL ? e->text : NULL;
  return leave(fn, e != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE, -1);
}

/* ------------------------------------------------------------------ libcuda: devices */

CUresult cuInit(unsigned int flags) {
  static const char fn[] = "cuInit";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (flags != 0) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  const CUresult blocked = wait_until_running(fn);
  if (blocked != CUDA_SUCCESS) return leave(fn, blocked, -1);
  if (fake.gpu_count == 0) return leave(fn, CUDA_ERROR_NO_DEVICE, -1);
  if (!fake.initialized) {
    fake.initialized = 1;
    fake.restore_tid = current_tid();
  }
  return leave(fn, CUDA_SUCCESS, -1);
}

CUresult cuDeviceGetCount(int *count) {
  static const char fn[] = "cuDeviceGetCount";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (count == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = device_call_ready(fn);
  if (rc == CUDA_SUCCESS) *count = fake.gpu_count;
  return leave(fn, rc, -1);
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
  static const char fn[] = "cuDeviceGet";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (device == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = device_call_ready(fn);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  if (ordinal < 0 || ordinal >= fake.gpu_count) return leave(fn, CUDA_ERROR_INVALID_DEVICE, -1);
  *device = ordinal;
  return leave(fn, CUDA_SUCCESS, -1);
}

/* fact `remap-keeps-old-identity`: after a remap the driver's cuDeviceGetUuid names the GPU a device is on now
 * (placement[]), while its PCI bus id stays that of the GPU it was on at first, as do torch's cached
 * properties; name and memory are the same model's on both. */
static CUresult device_ready(const char *function, CUdevice dev) {
  const CUresult rc = device_call_ready(function);
  if (rc != CUDA_SUCCESS) return rc;
  return (dev < 0 || dev >= fake.gpu_count) ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

static void copy_truncated(char *out, int len, const char *text) {
  const size_t size = (size_t)len;
  size_t length = strlen(text);
  if (length >= size) length = size - 1;
  memcpy(out, text, length);
  out[length] = '\0';
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  static const char fn[] = "cuDeviceGetName";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (name == NULL || len <= 0) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = device_ready(fn, dev);
  if (rc == CUDA_SUCCESS) copy_truncated(name, len, fake.gpus[dev].name);
  return leave(fn, rc, -1);
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
  static const char fn[] = "cuDeviceGetUuid";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (uuid == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = device_ready(fn, dev);
  if (rc == CUDA_SUCCESS) *uuid = fake.gpus[fake.placement[dev]].uuid;
  return leave(fn, rc, -1);
}

CUresult cuDeviceTotalMem(size_t *bytes, CUdevice dev) {
  static const char fn[] = "cuDeviceTotalMem";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (bytes == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = device_ready(fn, dev);
  if (rc == CUDA_SUCCESS) *bytes = (size_t)fake.gpus[dev].total;
  return leave(fn, rc, -1);
}

/* Every pair of distinct GPUs can reach each other (NVLink on the H200 hosts), unless
 * fake_set_peer_access(0). */
CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev) {
  static const char fn[] = "cuDeviceCanAccessPeer";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (canAccessPeer == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = device_ready(fn, dev);
  if (rc == CUDA_SUCCESS) rc = device_ready(fn, peerDev);
  if (rc == CUDA_SUCCESS) *canAccessPeer = dev != peerDev && !fake.no_peer_access;
  return leave(fn, rc, -1);
}

CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
  static const char fn[] = "cuDeviceGetPCIBusId";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (pciBusId == NULL || len <= 0) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = device_ready(fn, dev);
  if (rc == CUDA_SUCCESS) copy_truncated(pciBusId, len, fake.gpus[dev].pci_bus_id);
  return leave(fn, rc, -1);
}

/* ------------------------------------------------------------------ libcuda: checkpoint */

/* Only this process is a CUDA process here. For any other pid the fake answers
 * CUDA_ERROR_INVALID_VALUE, what tools built on the real driver report for a pid that owns no
 * CUDA checkpoint state (an unmeasured choice; NOT_INITIALIZED is the other answer seen). */
static int is_own_pid(int pid) { return pid == (int)getpid(); }

CUresult cuCheckpointProcessGetState(int pid, int *state) {
  static const char fn[] = "cuCheckpointProcessGetState";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (state == NULL || !is_own_pid(pid)) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  *state = fake.state;
  return leave(fn, CUDA_SUCCESS, -1);
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
  static const char fn[] = "cuCheckpointProcessGetRestoreThreadId";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (tid == NULL || !is_own_pid(pid)) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  if (!fake.initialized) return leave(fn, CUDA_ERROR_NOT_INITIALIZED, -1);
  *tid = (int)fake.restore_tid;
  return leave(fn, CUDA_SUCCESS, -1);
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
  static const char fn[] = "cuCheckpointProcessLock";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (!is_own_pid(pid)) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  if (args != NULL && (args->reserved0 != 0 || !all_zero(args->reserved1, sizeof(args->reserved1)))) {
    return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  }
  if (fake.state != CU_PROCESS_STATE_RUNNING) return leave(fn, CUDA_ERROR_ILLEGAL_STATE, -1);
  /* The process's in-flight work takes lock_delay_ms to drain; a timeout (0: none) shorter than
   * that gives up after the timeout. */
  const unsigned int busy = fake.lock_delay_ms;
  const unsigned int timeout = args != NULL ? args->timeoutMs : 0;
  if (busy > 0) {
    const int times_out = timeout != 0 && timeout < busy;
    pthread_mutex_unlock(&mutex);
    sleep_ms(times_out ? timeout : busy);
    pthread_mutex_lock(&mutex);
    if (times_out) return leave(fn, CUDA_ERROR_TIMEOUT, -1);
    if (fake.state != CU_PROCESS_STATE_RUNNING) return leave(fn, CUDA_ERROR_ILLEGAL_STATE, -1);
  }
  set_state(CU_PROCESS_STATE_LOCKED);
  fake.lock_tid = current_tid();
  return leave(fn, CUDA_SUCCESS, -1);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
  static const char fn[] = "cuCheckpointProcessCheckpoint";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (!is_own_pid(pid)) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  if (args != NULL && !all_zero(args, sizeof(*args))) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  if (fake.state != CU_PROCESS_STATE_LOCKED) return leave(fn, CUDA_ERROR_ILLEGAL_STATE, -1);
  /* fact `managed-memory-refused`: refused, the process stays LOCKED and an unlock brings it back. */
  for (int i = 0; i < MAX_VMM; ++i) {
    if (vmm.managed[i].used) return leave(fn, CUDA_ERROR_NOT_SUPPORTED, -1);
  }
  vmm_collect();
  vmm_checkpoint();
  fake.image_has_imported = 0;
  fake.pinned_at_checkpoint = 0;
  for (int i = 0; i < MAX_VMM; ++i) {
    if (vmm.handles[i].used && vmm.handles[i].imported) fake.image_has_imported = 1;
    fake.pinned_at_checkpoint += vmm.host[i].used ? vmm.host[i].size : 0;
  }
  set_state(CU_PROCESS_STATE_CHECKPOINTED);
  return leave(fn, CUDA_SUCCESS, -1);
}

/* Works out where each logical device goes; returns CUDA_SUCCESS and fills target[]. */
static CUresult plan_restore(const CUcheckpointRestoreArgs *args, int target[MAX_GPUS]) {
  for (int l = 0; l < fake.gpu_count; ++l) target[l] = fake.placement[l];
  if (args == NULL) return CUDA_SUCCESS;
  const size_t tail = offsetof(CUcheckpointRestoreArgs, gpuPairsCount) + sizeof(unsigned int);
  if (!all_zero((const char *)args + tail, sizeof(*args) - tail)) return CUDA_ERROR_INVALID_VALUE;
  if (args->gpuPairs == NULL && args->gpuPairsCount == 0) return CUDA_SUCCESS;
  if (args->gpuPairs == NULL || args->gpuPairsCount == 0) return CUDA_ERROR_INVALID_VALUE;
  /* GPU pairs came with driver 580 (CUDA 13.0); an older driver sees non-zero reserved bytes. */
  if (fake.cuda_version < 13000) return CUDA_ERROR_INVALID_VALUE;
  /* fact `restore-pairs-every-gpu`: every visible GPU exactly once on each side, a permutation. */
  if (args->gpuPairsCount != (unsigned int)fake.gpu_count) return CUDA_ERROR_INVALID_VALUE;
  int seen_old[MAX_GPUS] = {0};
  int seen_new[MAX_GPUS] = {0};
  for (unsigned int i = 0; i < args->gpuPairsCount; ++i) {
    const int from = physical_by_uuid(&args->gpuPairs[i].oldUuid);
    const int to = physical_by_uuid(&args->gpuPairs[i].newUuid);
    if (from < 0 || to < 0 || seen_old[from] || seen_new[to]) return CUDA_ERROR_INVALID_VALUE;
    seen_old[from] = seen_new[to] = 1;
    /* The driver restores onto a GPU "of the same chip type" only; the code it gives for a
     * mismatch is unmeasured. */
    if (strcmp(fake.gpus[from].name, fake.gpus[to].name) != 0) return CUDA_ERROR_INVALID_VALUE;
    for (int l = 0; l < fake.gpu_count; ++l) {
      if (fake.placement[l] == from) target[l] = to;
    }
  }
  return CUDA_SUCCESS;
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
  static const char fn[] = "cuCheckpointProcessRestore";
  const int pairs = args != NULL && args->gpuPairs != NULL ? (int)args->gpuPairsCount : 0;
  int rc;
  const int injected = enter(fn, &rc);
  /* Recorded as asked, whether or not the restore succeeds. */
  fake.last_pairs_count = pairs;
  for (int i = 0; i < pairs && i < MAX_GPUS * 4; ++i) {
    fake.last_pairs_old[i] = physical_by_uuid(&args->gpuPairs[i].oldUuid);
    fake.last_pairs_new[i] = physical_by_uuid(&args->gpuPairs[i].newUuid);
  }
  if (injected) {
    /* Only a restore refused for its arguments was measured to leave the process restorable (fact
     * `failed-restore-stays-checkpointed`); every other failure measured left it so for good. */
    if (rc != CUDA_ERROR_INVALID_VALUE && fake.failed_restore_poisons) fake.restore_poisoned = 1;
    return leave(fn, rc, pairs);
  }
  if (!is_own_pid(pid)) return leave(fn, CUDA_ERROR_INVALID_VALUE, pairs);
  if (fake.state != CU_PROCESS_STATE_CHECKPOINTED) return leave(fn, CUDA_ERROR_ILLEGAL_STATE, pairs);
  /* NVIDIA/cuda-checkpoint issue 44 (driver 580.95): after a restore failed for memory, every
   * later restore fails with CUDA_ERROR_OPERATING_SYSTEM. Off unless a test turns it on. */
  if (fake.restore_poisoned) return leave(fn, CUDA_ERROR_OPERATING_SYSTEM, pairs);
  if (fake.image_has_imported) return leave(fn, CUDA_ERROR_NOT_SUPPORTED, pairs);
  int target[MAX_GPUS];
  rc = plan_restore(args, target);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, pairs);
  vmm_collect();
  for (int p = 0; p < fake.gpu_count; ++p) {
    /* VMM memory in the image lands with its device; memory held only by fds stays put
     * (fact `exported-fd-survives-checkpoint`). */
    unsigned long long need = vmm_riding_bytes_to(p, target);
    for (int l = 0; l < fake.gpu_count; ++l) {
      if (target[l] == p) need += fake.process_bytes[l];
    }
    const struct gpu *g = &fake.gpus[p];
    const unsigned long long held = fake.reserved_bytes + others_on(p) + vmm_bytes_on(p, 1);
    const unsigned long long free_bytes = held >= g->total ? 0 : g->total - held;
    if (need > free_bytes) {
      if (fake.failed_restore_poisons) fake.restore_poisoned = 1;
      return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, pairs);
    }
  }
  for (int l = 0; l < fake.gpu_count; ++l) fake.placement[l] = target[l];
  vmm_restored(target);
  set_state(CU_PROCESS_STATE_LOCKED);
  return leave(fn, CUDA_SUCCESS, pairs);
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
  static const char fn[] = "cuCheckpointProcessUnlock";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (!is_own_pid(pid)) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  if (args != NULL && !all_zero(args, sizeof(*args))) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  if (fake.state != CU_PROCESS_STATE_LOCKED) return leave(fn, CUDA_ERROR_ILLEGAL_STATE, -1);
  set_state(CU_PROCESS_STATE_RUNNING);
  return leave(fn, CUDA_SUCCESS, -1);
}

/* ------------------------------------------------------------------ libcuda: contexts */

static CUcontext token_of(int device) { return (CUcontext)&primary_tokens[device]; }

static int device_of_token(CUcontext ctx) {
  const char *p = (const char *)ctx;
  if (p < primary_tokens || p >= primary_tokens + MAX_GPUS) return -1;
  const int device = (int)(p - primary_tokens);
  return device < fake.gpu_count ? device : -1;
}

/* A call that works in the current context: it must exist and be active (retained). */
static CUresult context_ready(const char *function, int *device) {
  const CUresult rc = device_call_ready(function);
  if (rc != CUDA_SUCCESS) return rc;
  const int d = current_context;
  if (d < 0 || d >= fake.gpu_count || vmm.primary_refs[d] == 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (device != NULL) *device = d;
  return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
  static const char fn[] = "cuCtxGetCurrent";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (pctx == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = device_call_ready(fn);
  if (rc == CUDA_SUCCESS) *pctx = current_context >= 0 ? token_of(current_context) : NULL;
  return leave(fn, rc, -1);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  static const char fn[] = "cuCtxSetCurrent";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = device_call_ready(fn);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  if (ctx == NULL) {
    current_context = -1;
    return leave(fn, CUDA_SUCCESS, -1);
  }
  const int device = device_of_token(ctx);
  if (device < 0) return leave(fn, CUDA_ERROR_INVALID_CONTEXT, -1);
  current_context = device;
  return leave(fn, CUDA_SUCCESS, -1);
}

CUresult cuCtxGetDevice(CUdevice *device) {
  static const char fn[] = "cuCtxGetDevice";
  int rc, d = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (device == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = context_ready(fn, &d);
  if (rc == CUDA_SUCCESS) *device = d;
  return leave(fn, rc, -1);
}

CUresult cuCtxSynchronize(void) {
  static const char fn[] = "cuCtxSynchronize";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  return leave(fn, context_ready(fn, NULL), -1); /* copies here are done when they return */
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  static const char fn[] = "cuDevicePrimaryCtxRetain";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (pctx == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = device_ready(fn, dev);
  if (rc == CUDA_SUCCESS) {
    ++vmm.primary_refs[dev];
    *pctx = token_of(dev);
  }
  return leave(fn, rc, -1);
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
  static const char fn[] = "cuDevicePrimaryCtxRelease";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = device_ready(fn, dev);
  if (rc == CUDA_SUCCESS && vmm.primary_refs[dev] == 0) rc = CUDA_ERROR_INVALID_CONTEXT;
  if (rc == CUDA_SUCCESS) --vmm.primary_refs[dev];
  return leave(fn, rc, -1);
}

/* Active while retained: the fake's primary contexts live as long as someone holds them. */
CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
  static const char fn[] = "cuDevicePrimaryCtxGetState";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (flags == NULL || active == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = device_ready(fn, dev);
  if (rc == CUDA_SUCCESS) {
    *flags = 0;
    *active = vmm.primary_refs[dev] > 0;
  }
  return leave(fn, rc, -1);
}

/* ------------------------------------------------------------------ libcuda: VMM */

/* Device memory, or host memory on a NUMA node (as NCCL makes its shared host memory). */
static int prop_valid(const CUmemAllocationProp *prop) {
  return prop != NULL && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
         ((prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && prop->location.id >= 0 &&
           prop->location.id < fake.gpu_count) ||
          (prop->location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA && prop->location.id >= 0)) &&
         (prop->requestedHandleTypes == 0 ||
          prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) &&
         prop->win32HandleMetaData == NULL && prop->allocFlags.compressionType == 0 &&
         prop->allocFlags.usage == 0 && all_zero(prop->allocFlags.reserved, sizeof(prop->allocFlags.reserved));
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option) {
  static const char fn[] = "cuMemGetAllocationGranularity";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (granularity == NULL || !prop_valid(prop) || (option != 0 && option != 1)) {
    return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  }
  rc = device_call_ready(fn);
  if (rc == CUDA_SUCCESS) *granularity = (size_t)VMM_GRANULARITY;
  return leave(fn, rc, -1);
}

static int free_slot(const void *table, size_t stride) {
  for (int i = 0; i < MAX_VMM; ++i) {
    if (*(const int *)((const char *)table + (size_t)i * stride) == 0) return i;
  }
  return -1;
}
#define FREE_SLOT(array) free_slot((array), sizeof((array)[0]))

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  static const char fn[] = "cuMemAddressReserve";
  int rc;
  (void)addr; /* a hint only */
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  if (ptr == NULL || size == 0 || size % page != 0 || flags != 0 || (alignment & (alignment - 1)) != 0) {
    return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  }
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  const int slot = FREE_SLOT(vmm.reservations);
  if (slot < 0) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  const size_t align = alignment > VMM_GRANULARITY ? alignment : (size_t)VMM_GRANULARITY;
  char *raw = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  char *base = (char *)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
  if (base > raw) munmap(raw, (size_t)(base - raw));
  if (base + size < raw + size + align) munmap(base + size, (size_t)(raw + size + align - (base + size)));
  vmm.reservations[slot] = (struct vmm_range){1, (uintptr_t)base, size, -1, 0, 0};
  *ptr = (CUdeviceptr)(uintptr_t)base;
  return leave(fn, CUDA_SUCCESS, -1);
}

static int find_range(struct vmm_range *table, uintptr_t base, size_t size) {
  for (int i = 0; i < MAX_VMM; ++i) {
    if (table[i].used && table[i].base == base && table[i].size == size) return i;
  }
  return -1;
}

/* The mapping holding address `at`, or -1. */
static int mapping_at(uintptr_t at) {
  for (int i = 0; i < MAX_VMM; ++i) {
    const struct vmm_range *m = &vmm.mappings[i];
    if (m->used && at >= m->base && at < m->base + m->size) return i;
  }
  return -1;
}

static int overlaps_mapping(uintptr_t base, size_t size) {
  for (int i = 0; i < MAX_VMM; ++i) {
    const struct vmm_range *m = &vmm.mappings[i];
    if (m->used && base < m->base + m->size && m->base < base + size) return 1;
  }
  return 0;
}

/* The driver wants the range exactly as reserved, and (unmeasured; strict here) nothing mapped in it. */
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  static const char fn[] = "cuMemAddressFree";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  const int slot = find_range(vmm.reservations, (uintptr_t)ptr, size);
  if (slot < 0 || overlaps_mapping((uintptr_t)ptr, size)) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  munmap((void *)(uintptr_t)ptr, size);
  memset(&vmm.reservations[slot], 0, sizeof(vmm.reservations[slot]));
  return leave(fn, CUDA_SUCCESS, -1);
}

static int new_handle(int alloc) {
  const int slot = FREE_SLOT(vmm.handles);
  if (slot < 0) return -1;
  vmm.handles[slot] = (struct vmm_handle){1, 0x1000 + ++vmm.next_handle, alloc, 0};
  ++vmm.allocs[alloc].handles;
  return slot;
}

static int find_handle(CUmemGenericAllocationHandle value) {
  for (int i = 0; i < MAX_VMM; ++i) {
    if (vmm.handles[i].used && vmm.handles[i].value == value) return i;
  }
  return -1;
}

/* Out of memory when the GPU the device is on now has less free than asked (free = total -
 * other processes - this process, set_process_memory and VMM alike). */
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
  static const char fn[] = "cuMemCreate";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (handle == NULL || size == 0 || size % VMM_GRANULARITY != 0 || flags != 0 || !prop_valid(prop)) {
    return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  }
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  const int on_host = prop->location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA;
  const int physical = on_host ? -1 : fake.placement[prop->location.id];
  if (!on_host) {
    const struct gpu *g = &fake.gpus[physical];
    const unsigned long long used = fake.reserved_bytes + others_on(physical) + process_bytes_on(physical);
    if (used >= g->total || size > g->total - used) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  }
  const int slot = FREE_SLOT(vmm.allocs);
  if (slot < 0) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  /* The name tells a process importing the fd where the memory lives (adopt_foreign): on the host,
   * or on which physical GPU, where it stays whoever imports it. */
  char name[48];
  if (on_host) {
    snprintf(name, sizeof name, "%s", HOST_MEMFD_NAME);
  } else {
    snprintf(name, sizeof name, "%s%d", GPU_MEMFD_PREFIX, physical);
  }
  const int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  struct stat st;
  if (ftruncate(fd, (off_t)size) != 0 || fstat(fd, &st) != 0) {
    close(fd);
    return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  }
  struct vmm_alloc *a = &vmm.allocs[slot];
  *a = (struct vmm_alloc){1, fd, st.st_dev, st.st_ino, size, physical, -1,
                          prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0, 0, 0, 0,
                          prop->location.type, prop->location.id};
  const int h = new_handle(slot);
  if (h < 0) {
    close(fd);
    memset(a, 0, sizeof(*a));
    return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  }
  *handle = vmm.handles[h].value;
  return leave(fn, CUDA_SUCCESS, -1);
}

/* A new handle to the allocation mapped at `addr` (the start of a mapping or inside one), as the
 * driver's; nothing else is a cuMem allocation. Needs no current context. */
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
  static const char fn[] = "cuMemRetainAllocationHandle";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  const int m = mapping_at((uintptr_t)addr);
  if (handle == NULL || m < 0) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  const int h = new_handle(vmm.mappings[m].alloc);
  if (h < 0) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  *handle = vmm.handles[h].value;
  return leave(fn, CUDA_SUCCESS, -1);
}

enum { CU_POINTER_ATTRIBUTE_IS_MANAGED = 8 };

static int managed_at(uintptr_t at) {
  for (int i = 0; i < MAX_VMM; ++i) {
    const struct managed_block *m = &vmm.managed[i];
    if (m->used && at >= m->base && at < m->base + m->size) return i;
  }
  return -1;
}

/* Only CU_POINTER_ATTRIBUTE_IS_MANAGED: 1 in managed memory, 0 in VMM memory, and
 * CUDA_ERROR_INVALID_VALUE for an address the driver does not know, as the real one. */
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
  static const char fn[] = "cuPointerGetAttribute";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (data == NULL || attribute != CU_POINTER_ATTRIBUTE_IS_MANAGED) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  const int managed = managed_at((uintptr_t)ptr) >= 0;
  if (!managed && mapping_at((uintptr_t)ptr) < 0) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  *(unsigned int *)data = (unsigned int)managed;
  return leave(fn, CUDA_SUCCESS, -1);
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
  static const char fn[] = "cuMemAllocManaged";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (dptr == NULL || bytesize == 0 || flags != 1 /* CU_MEM_ATTACH_GLOBAL */) {
    return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  }
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  const int slot = FREE_SLOT(vmm.managed);
  const int fd = slot < 0 ? -1 : memfd_create("fake_cuda_uvm", MFD_CLOEXEC);
  if (fd < 0) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  void *p = ftruncate(fd, (off_t)bytesize) == 0
                ? mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                : MAP_FAILED;
  close(fd); /* the mapping keeps the memory */
  if (p == MAP_FAILED) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  vmm.managed[slot] = (struct managed_block){1, (uintptr_t)p, bytesize};
  *dptr = (CUdeviceptr)(uintptr_t)p;
  return leave(fn, CUDA_SUCCESS, -1);
}

/* Frees what cuMemAllocManaged made (the fake has no other cuMemAlloc memory). */
CUresult cuMemFree(CUdeviceptr dptr) {
  static const char fn[] = "cuMemFree";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  for (int k = 0; k < MAX_PLAIN; ++k) {
    if (vmm.plain[k].used && vmm.plain[k].base == (uintptr_t)dptr) {
      free((void *)vmm.plain[k].base);
      memset(&vmm.plain[k], 0, sizeof(vmm.plain[k]));
      return leave(fn, CUDA_SUCCESS, -1);
    }
  }
  const int i = managed_at((uintptr_t)dptr);
  if (i < 0 || vmm.managed[i].base != (uintptr_t)dptr) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  munmap((void *)vmm.managed[i].base, vmm.managed[i].size);
  memset(&vmm.managed[i], 0, sizeof(vmm.managed[i]));
  return leave(fn, CUDA_SUCCESS, -1);
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle) {
  static const char fn[] = "cuMemGetAllocationPropertiesFromHandle";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  const int h = find_handle(handle);
  if (prop == NULL || h < 0) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  const struct vmm_alloc *a = &vmm.allocs[vmm.handles[h].alloc];
  memset(prop, 0, sizeof(*prop));
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->requestedHandleTypes = a->exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : 0;
  prop->location.type = a->location_type;
  prop->location.id = a->location_id;
  return leave(fn, CUDA_SUCCESS, -1);
}

/* The memory itself goes when nothing else refers to it (mappings, other handles, fds). */
CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  static const char fn[] = "cuMemRelease";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  const int h = find_handle(handle);
  if (h < 0) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  --vmm.allocs[vmm.handles[h].alloc].handles;
  memset(&vmm.handles[h], 0, sizeof(vmm.handles[h]));
  vmm_collect();
  return leave(fn, CUDA_SUCCESS, -1);
}

static int inside_reservation(uintptr_t base, size_t size) {
  for (int i = 0; i < MAX_VMM; ++i) {
    const struct vmm_range *r = &vmm.reservations[i];
    if (r->used && base >= r->base && base + size <= r->base + r->size) return 1;
  }
  return 0;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  static const char fn[] = "cuMemMap";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  const int h = find_handle(handle);
  if (h < 0 || flags != 0 || size == 0 || ptr % VMM_GRANULARITY != 0 || size % VMM_GRANULARITY != 0 ||
      offset % VMM_GRANULARITY != 0) {
    return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  }
  const int alloc = vmm.handles[h].alloc;
  struct vmm_alloc *a = &vmm.allocs[alloc];
  const uintptr_t base = (uintptr_t)ptr;
  if (offset + size > a->size || !inside_reservation(base, size) || overlaps_mapping(base, size)) {
    return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  }
  const int slot = FREE_SLOT(vmm.mappings);
  if (slot < 0) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  if (mmap((void *)base, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, (off_t)offset) == MAP_FAILED) {
    return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  }
  vmm.mappings[slot] = (struct vmm_range){1, base, size, alloc, 0, 0};
  ++a->mappings;
  return leave(fn, CUDA_SUCCESS, -1);
}

/* Strict: exactly one earlier cuMemMap range (the driver also takes several whole ones). */
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  static const char fn[] = "cuMemUnmap";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  const int slot = find_range(vmm.mappings, (uintptr_t)ptr, size);
  if (slot < 0) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  /* Back to a bare reservation. */
  mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  --vmm.allocs[vmm.mappings[slot].alloc].mappings;
  memset(&vmm.mappings[slot], 0, sizeof(vmm.mappings[slot]));
  vmm_collect();
  return leave(fn, CUDA_SUCCESS, -1);
}

/* The range must consist of whole mappings, back to back. */
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  static const char fn[] = "cuMemSetAccess";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (desc == NULL || count == 0 || size == 0) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  for (size_t k = 0; k < count; ++k) {
    const int flags = (int)desc[k].flags;
    if (desc[k].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[k].location.id < 0 ||
        desc[k].location.id >= fake.gpu_count || (flags != 0 && flags != 1 && flags != 3)) {
      return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
    }
  }
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  int slots[MAX_VMM];
  int n = 0;
  for (uintptr_t at = (uintptr_t)ptr; at < (uintptr_t)ptr + size;) {
    int found = -1;
    for (int i = 0; i < MAX_VMM && found < 0; ++i) {
      if (vmm.mappings[i].used && vmm.mappings[i].base == at) found = i;
    }
    if (found < 0 || at + vmm.mappings[found].size > (uintptr_t)ptr + size) {
      return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
    }
    slots[n++] = found;
    at += vmm.mappings[found].size;
  }
  for (int k = 0; k < n; ++k) {
    struct vmm_range *m = &vmm.mappings[slots[k]];
    for (size_t j = 0; j < count; ++j) {
      const unsigned int bit = 1u << desc[j].location.id;
      const int flags = (int)desc[j].flags;
      m->readers = flags != 0 ? m->readers | bit : m->readers & ~bit;
      m->writers = flags == 3 ? m->writers | bit : m->writers & ~bit;
    }
    const int prot = m->writers ? PROT_READ | PROT_WRITE : m->readers ? PROT_READ : PROT_NONE;
    mprotect((void *)m->base, m->size, prot);
  }
  return leave(fn, CUDA_SUCCESS, -1);
}

CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle, int handleType,
                                      unsigned long long flags) {
  static const char fn[] = "cuMemExportToShareableHandle";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (shareableHandle == NULL || flags != 0 || handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  }
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  const int h = find_handle(handle);
  if (h < 0 || !vmm.allocs[vmm.handles[h].alloc].exportable) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  const int fd = fcntl(vmm.allocs[vmm.handles[h].alloc].fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return leave(fn, CUDA_ERROR_OPERATING_SYSTEM, -1);
  *(int *)shareableHandle = fd;
  return leave(fn, CUDA_SUCCESS, -1);
}

/* The fd stays the caller's; the new handle is one more reference to the same memory. */
/* An fd from another process (the copier imports the job's segments): a memfd of a granularity
 * multiple becomes an allocation of its own here, on the GPU of the current context, counted for
 * the process that made it. -1 if the fd is no such memfd. */
/* Whether the memfd behind `fd` is host memory (cuMemCreate on a host NUMA node, in any process). */
static int host_memfd(int fd) {
  char link[64], target[128];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, target, sizeof target - 1);
  if (n <= 0) return 0;
  target[n] = '\0';
  return strstr(target, "memfd:" HOST_MEMFD_NAME " ") != NULL;
}

/* The physical GPU a memfd made by cuMemCreate (in any process) lives on; -1: not one of those. */
static int memfd_gpu(int fd) {
  char link[64], target[128];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, target, sizeof target - 1);
  if (n <= 0) return -1;
  target[n] = '\0';
  const char *at = strstr(target, "memfd:" GPU_MEMFD_PREFIX);
  if (at == NULL) return -1;
  const int physical = atoi(at + strlen("memfd:" GPU_MEMFD_PREFIX));
  return physical >= 0 && physical < fake.gpu_count ? physical : -1;
}

/* The logical device of this process on physical GPU `physical`; -1 where it has none. */
static int logical_on(int physical) {
  for (int l = 0; l < fake.gpu_count; ++l) {
    if (fake.placement[l] == physical) return l;
  }
  return -1;
}

static int adopt_foreign(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 || (size_t)st.st_size % VMM_GRANULARITY != 0) {
    return -1;
  }
  const int slot = FREE_SLOT(vmm.allocs);
  if (slot < 0 || current_context < 0) return -1;
  const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) return -1;
  struct vmm_alloc *a = &vmm.allocs[slot];
  /* Not exportable: an allocation imported from another process cannot be exported again (fact
   * `exported-fd-survives-checkpoint`, its holder mode: CUDA_ERROR_INVALID_VALUE). */
  const int on_host = host_memfd(fd);
  /* Device memory stays on the GPU it was made on, whichever context imports it (cuMemImportFromShareableHandle
   * names the existing allocation). A memfd of unknown origin counts as the importer's GPU's. */
  int physical = on_host ? -1 : memfd_gpu(fd);
  if (!on_host && physical < 0) physical = fake.placement[current_context];
  const int logical = on_host ? 0 : logical_on(physical);
  *a = (struct vmm_alloc){1, own, st.st_dev, st.st_ino, (size_t)st.st_size, physical,
                          -1, 0, 0, 0, 1, 0, on_host ? CU_MEM_LOCATION_TYPE_HOST_NUMA : CU_MEM_LOCATION_TYPE_DEVICE,
                          logical < 0 ? current_context : logical};
  return slot;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle, int shHandleType) {
  static const char fn[] = "cuMemImportFromShareableHandle";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (handle == NULL || shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  }
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  const int fd = (int)(intptr_t)osHandle;
  int alloc = -1;
  for (int i = 0; i < MAX_VMM && alloc < 0; ++i) {
    if (vmm.allocs[i].used && fd_refers_to(fd, &vmm.allocs[i])) alloc = i;
  }
  if (alloc < 0) alloc = adopt_foreign(fd);
  if (alloc < 0) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  struct vmm_alloc *a = &vmm.allocs[alloc];
  if (!a->foreign && a->handles == 0 && a->mappings == 0) a->imported = 1;
  const int h = new_handle(alloc);
  if (h < 0) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  vmm.handles[h].imported = 1;
  *handle = vmm.handles[h].value;
  return leave(fn, CUDA_SUCCESS, -1);
}

/* ------------------------------------------------------------------ libcuda: copies, pinned memory, streams */

static int stream_valid(CUstream stream) {
  if (stream == NULL) return 1;
  for (const struct fake_stream *s = vmm.streams; s != NULL; s = s->next) {
    if ((const void *)s == (const void *)stream) return 1;
  }
  return 0;
}

/* Device memory the current device may touch: within one mapping that grants it access.
 * INVALID_VALUE for an address of no mapping; ILLEGAL_ADDRESS where the real copy would fault. */
static CUresult device_range(CUdeviceptr ptr, size_t size, int device, int write) {
  for (int i = 0; i < MAX_VMM; ++i) {
    const struct vmm_range *m = &vmm.mappings[i];
    if (!m->used || (uintptr_t)ptr < m->base || (uintptr_t)ptr + size > m->base + m->size) continue;
    const unsigned int mask = write ? m->writers : m->readers;
    return (mask & (1u << device)) ? CUDA_SUCCESS : CUDA_ERROR_ILLEGAL_ADDRESS;
  }
  for (int i = 0; i < MAX_PLAIN; ++i) {
    const struct plain_block *b = &vmm.plain[i];
    if (!b->used || (uintptr_t)ptr < b->base || (uintptr_t)ptr + size > b->base + b->size) continue;
    return b->device == device ? CUDA_SUCCESS : CUDA_ERROR_ILLEGAL_ADDRESS;
  }
  return CUDA_ERROR_INVALID_VALUE;
}

static CUresult copy_ready(const char *function, CUstream stream, int *device) {
  const CUresult rc = context_ready(function, device);
  if (rc != CUDA_SUCCESS) return rc;
  return stream_valid(stream) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Copies finish before they return: a stream or context synchronize has nothing left to wait for. */
CUresult cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
  static const char fn[] = "cuMemcpyDtoDAsync";
  int rc, device = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = copy_ready(fn, hStream, &device);
  if (rc == CUDA_SUCCESS) rc = device_range(srcDevice, ByteCount, device, 0);
  if (rc == CUDA_SUCCESS) rc = device_range(dstDevice, ByteCount, device, 1);
  if (rc == CUDA_SUCCESS) {
    memmove((void *)(uintptr_t)dstDevice, (const void *)(uintptr_t)srcDevice, ByteCount);
    corrupt_if_due(fn, (void *)(uintptr_t)dstDevice, ByteCount);
  }
  return leave(fn, rc, -1);
}

CUresult cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
  static const char fn[] = "cuMemcpyDtoHAsync";
  int rc, device = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (dstHost == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = copy_ready(fn, hStream, &device);
  if (rc == CUDA_SUCCESS) rc = device_range(srcDevice, ByteCount, device, 0);
  if (rc == CUDA_SUCCESS) {
    memcpy(dstHost, (const void *)(uintptr_t)srcDevice, ByteCount);
    corrupt_if_due(fn, dstHost, ByteCount);
  }
  return leave(fn, rc, -1);
}

CUresult cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream) {
  static const char fn[] = "cuMemcpyHtoDAsync";
  int rc, device = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (srcHost == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = copy_ready(fn, hStream, &device);
  if (rc == CUDA_SUCCESS) rc = device_range(dstDevice, ByteCount, device, 1);
  if (rc == CUDA_SUCCESS) {
    memcpy((void *)(uintptr_t)dstDevice, srcHost, ByteCount);
    corrupt_if_due(fn, (void *)(uintptr_t)dstDevice, ByteCount);
  }
  return leave(fn, rc, -1);
}

/* Registered (pinned) host ranges; overlapping registrations are refused as the driver does. */
CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags) {
  static const char fn[] = "cuMemHostRegister";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (p == NULL || bytesize == 0 || (Flags & ~15u) != 0) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  const uintptr_t start = (uintptr_t)p, end = start + bytesize;
  for (int i = 0; i < MAX_VMM; ++i) {
    const struct host_block *h = &vmm.host[i];
    if (h->used && start < (uintptr_t)h->ptr + h->size && (uintptr_t)h->ptr < end) {
      return leave(fn, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, -1);
    }
  }
  const int slot = FREE_SLOT(vmm.host);
  if (slot < 0) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  vmm.host[slot] = (struct host_block){1, p, bytesize};
  return leave(fn, CUDA_SUCCESS, -1);
}

CUresult cuMemHostUnregister(void *p) {
  static const char fn[] = "cuMemHostUnregister";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  for (int i = 0; i < MAX_VMM; ++i) {
    if (vmm.host[i].used && vmm.host[i].ptr == p) {
      memset(&vmm.host[i], 0, sizeof(vmm.host[i]));
      return leave(fn, CUDA_SUCCESS, -1);
    }
  }
  return leave(fn, CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, -1);
}

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
  static const char fn[] = "cuStreamCreate";
  int rc, device = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (phStream == NULL || Flags > 1) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = context_ready(fn, &device);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  struct fake_stream *s = calloc(1, sizeof(*s));
  if (s == NULL) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  s->device = device;
  s->next = vmm.streams;
  vmm.streams = s;
  ++vmm.stream_count;
  *phStream = (CUstream)s;
  return leave(fn, CUDA_SUCCESS, -1);
}

CUresult cuStreamSynchronize(CUstream hStream) {
  static const char fn[] = "cuStreamSynchronize";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = device_call_ready(fn);
  if (rc == CUDA_SUCCESS && !stream_valid(hStream)) rc = CUDA_ERROR_INVALID_HANDLE;
  return leave(fn, rc, -1);
}

CUresult cuStreamDestroy(CUstream hStream) {
  static const char fn[] = "cuStreamDestroy";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = device_call_ready(fn);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  for (struct fake_stream **p = &vmm.streams; *p != NULL; p = &(*p)->next) {
    if ((void *)*p == (void *)hStream) {
      struct fake_stream *s = *p;
      *p = s->next;
      free(s);
      --vmm.stream_count;
      return leave(fn, CUDA_SUCCESS, -1);
    }
  }
  return leave(fn, CUDA_ERROR_INVALID_HANDLE, -1);
}

/* Events: copies finish before they return, so an event is complete once recorded. */
static int event_valid(CUevent event) {
  for (const struct fake_event *e = vmm.events; e != NULL; e = e->next) {
    if ((const void *)e == (const void *)event) return 1;
  }
  return 0;
}

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
  static const char fn[] = "cuEventCreate";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (phEvent == NULL || Flags > 15u) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = context_ready(fn, NULL);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  struct fake_event *e = calloc(1, sizeof(*e));
  if (e == NULL) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
  e->next = vmm.events;
  vmm.events = e;
  ++vmm.event_count;
  *phEvent = (CUevent)e;
  return leave(fn, CUDA_SUCCESS, -1);
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
  static const char fn[] = "cuEventRecord";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = context_ready(fn, NULL);
  if (rc == CUDA_SUCCESS && (!event_valid(hEvent) || !stream_valid(hStream))) rc = CUDA_ERROR_INVALID_HANDLE;
  return leave(fn, rc, -1);
}

CUresult cuEventSynchronize(CUevent hEvent) {
  static const char fn[] = "cuEventSynchronize";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = device_call_ready(fn);
  if (rc == CUDA_SUCCESS && !event_valid(hEvent)) rc = CUDA_ERROR_INVALID_HANDLE;
  return leave(fn, rc, -1);
}

CUresult cuEventDestroy(CUevent hEvent) {
  static const char fn[] = "cuEventDestroy";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = device_call_ready(fn);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  for (struct fake_event **p = &vmm.events; *p != NULL; p = &(*p)->next) {
    if ((void *)*p == (void *)hEvent) {
      struct fake_event *e = *p;
      *p = e->next;
      free(e);
      --vmm.event_count;
      return leave(fn, CUDA_SUCCESS, -1);
    }
  }
  return leave(fn, CUDA_ERROR_INVALID_HANDLE, -1);
}

/* ------------------------------------------------------------------ libcuda: the moves' checksum kernel */

/* flexium loads one kernel from PTX (csrc/move_checksum.cpp): a module per context, its one
 * function, launched with (words, pairs, first_word, out). Here the launch computes the same
 * function on the host, bit for bit: out += sum over k < 2 * pairs of mix(words[k], first_word + k). */
#define CHECKSUM_KERNEL "flexium_move_checksum"
static char module_tokens[MAX_GPUS];
static char function_tokens[MAX_GPUS];

static uint64_t checksum_mix(uint64_t word, uint64_t number) {
  uint64_t x = word ^ (number * 0x9E3779B97F4A7C15ull);
  x = (x ^ (x >> 31)) * 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 29);
}

CUresult cuModuleLoadData(CUmodule *module, const void *image) {
  static const char fn[] = "cuModuleLoadData";
  int rc, device = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (module == NULL || image == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = context_ready(fn, &device);
  /* Only flexium's PTX is understood; the real driver's JIT would refuse text that is not PTX. */
  if (rc == CUDA_SUCCESS && strstr((const char *)image, ".entry " CHECKSUM_KERNEL "(") == NULL) {
    rc = CUDA_ERROR_INVALID_IMAGE;
  }
  if (rc == CUDA_SUCCESS) *module = (CUmodule)&module_tokens[device];
  return leave(fn, rc, -1);
}

static int device_of_module(CUmodule module) {
  const char *p = (const char *)module;
  return p >= module_tokens && p < module_tokens + MAX_GPUS ? (int)(p - module_tokens) : -1;
}

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
  static const char fn[] = "cuModuleGetFunction";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (hfunc == NULL || name == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = device_call_ready(fn);
  const int device = device_of_module(hmod);
  if (rc == CUDA_SUCCESS && device < 0) rc = CUDA_ERROR_INVALID_HANDLE;
  if (rc == CUDA_SUCCESS && strcmp(name, CHECKSUM_KERNEL) != 0) rc = CUDA_ERROR_NOT_FOUND;
  if (rc == CUDA_SUCCESS) *hfunc = (CUfunction)&function_tokens[device];
  return leave(fn, rc, -1);
}

CUresult cuModuleUnload(CUmodule hmod) {
  static const char fn[] = "cuModuleUnload";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = device_call_ready(fn);
  if (rc == CUDA_SUCCESS && device_of_module(hmod) < 0) rc = CUDA_ERROR_INVALID_HANDLE;
  return leave(fn, rc, -1);
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                        unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra) {
  static const char fn[] = "cuLaunchKernel";
  int rc, device = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (kernelParams == NULL || extra != NULL || gridDimX == 0 || gridDimY == 0 || gridDimZ == 0 || blockDimX == 0 ||
      blockDimY == 0 || blockDimZ == 0 || blockDimX * blockDimY * blockDimZ > 1024 || sharedMemBytes > 0) {
    return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  }
  rc = copy_ready(fn, hStream, &device);
  /* A function runs only in the context whose module it came from. */
  if (rc == CUDA_SUCCESS && (const char *)f != &function_tokens[device]) rc = CUDA_ERROR_INVALID_HANDLE;
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  const CUdeviceptr words = *(const CUdeviceptr *)kernelParams[0];
  const uint64_t pairs = *(const uint64_t *)kernelParams[1];
  const uint64_t first_word = *(const uint64_t *)kernelParams[2];
  const CUdeviceptr out = *(const CUdeviceptr *)kernelParams[3];
  /* A misaligned load or one outside the memory faults the kernel, as on a GPU. */
  if (words % 16 != 0 || out % 8 != 0 || pairs > SIZE_MAX / 16) return leave(fn, CUDA_ERROR_ILLEGAL_ADDRESS, -1);
  if (pairs > 0) rc = device_range(words, (size_t)pairs * 16, device, 0);
  if (rc == CUDA_SUCCESS) rc = device_range(out, 8, device, 1);
  if (rc != CUDA_SUCCESS) return leave(fn, CUDA_ERROR_ILLEGAL_ADDRESS, -1);
  uint64_t sum = 0;
  const unsigned char *bytes = (const unsigned char *)(uintptr_t)words;
  for (uint64_t k = 0; k < 2 * pairs; ++k) {
    uint64_t word;
    memcpy(&word, bytes + k * 8, 8); /* little-endian, as the GPU reads it */
    sum += checksum_mix(word, first_word + k);
  }
  *(uint64_t *)(uintptr_t)out += sum;
  return leave(fn, CUDA_SUCCESS, -1);
}

CUresult cuMemAlloc(CUdeviceptr *dptr, size_t bytesize) {
  static const char fn[] = "cuMemAlloc";
  int rc, device = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (dptr == NULL || bytesize == 0) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = context_ready(fn, &device);
  if (rc != CUDA_SUCCESS) return leave(fn, rc, -1);
  for (int i = 0; i < MAX_PLAIN; ++i) {
    if (vmm.plain[i].used) continue;
    void *memory = NULL;
    if (posix_memalign(&memory, 256, bytesize) != 0) return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
    vmm.plain[i] = (struct plain_block){1, (uintptr_t)memory, bytesize, device};
    *dptr = (CUdeviceptr)(uintptr_t)memory;
    return leave(fn, CUDA_SUCCESS, -1);
  }
  return leave(fn, CUDA_ERROR_OUT_OF_MEMORY, -1);
}

CUresult cuMemsetD8(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
  static const char fn[] = "cuMemsetD8";
  int rc, device = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = context_ready(fn, &device);
  if (rc == CUDA_SUCCESS) rc = device_range(dstDevice, N, device, 1);
  if (rc == CUDA_SUCCESS) memset((void *)(uintptr_t)dstDevice, uc, N);
  return leave(fn, rc, -1);
}

CUresult cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
  static const char fn[] = "cuMemcpyDtoH";
  int rc, device = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  if (dstHost == NULL) return leave(fn, CUDA_ERROR_INVALID_VALUE, -1);
  rc = context_ready(fn, &device);
  if (rc == CUDA_SUCCESS) rc = device_range(srcDevice, ByteCount, device, 0);
  if (rc == CUDA_SUCCESS) memcpy(dstHost, (const void *)(uintptr_t)srcDevice, ByteCount);
  return leave(fn, rc, -1);
}

/* ------------------------------------------------------------------ NVML */

typedef struct gpu *nvmlDevice_t;

static const struct error_text nvml_errors[] = {
    {NVML_SUCCESS, "NVML_SUCCESS", "Success"},
    {NVML_ERROR_UNINITIALIZED, "NVML_ERROR_UNINITIALIZED", "Uninitialized"},
    {NVML_ERROR_INVALID_ARGUMENT, "NVML_ERROR_INVALID_ARGUMENT", "Invalid Argument"},
    {NVML_ERROR_NOT_SUPPORTED, "NVML_ERROR_NOT_SUPPORTED", "Not Supported"},
    {NVML_ERROR_NO_PERMISSION, "NVML_ERROR_NO_PERMISSION", "Insufficient Permissions"},
    {NVML_ERROR_ALREADY_INITIALIZED, "NVML_ERROR_ALREADY_INITIALIZED", "Already Initialized"},
    {NVML_ERROR_NOT_FOUND, "NVML_ERROR_NOT_FOUND", "Not Found"},
    {NVML_ERROR_INSUFFICIENT_SIZE, "NVML_ERROR_INSUFFICIENT_SIZE", "Insufficient Size"},
    {NVML_ERROR_DRIVER_NOT_LOADED, "NVML_ERROR_DRIVER_NOT_LOADED", "Driver Not Loaded"},
    {NVML_ERROR_TIMEOUT, "NVML_ERROR_TIMEOUT", "Timeout"},
    {NVML_ERROR_LIBRARY_NOT_FOUND, "NVML_ERROR_LIBRARY_NOT_FOUND", "NVML Shared Library Not Found"},
    {NVML_ERROR_FUNCTION_NOT_FOUND, "NVML_ERROR_FUNCTION_NOT_FOUND", "Function Not Found"},
    {NVML_ERROR_GPU_IS_LOST, "NVML_ERROR_GPU_IS_LOST", "GPU is lost"},
    {NVML_ERROR_IN_USE, "NVML_ERROR_IN_USE", "In use by another client"},
    {NVML_ERROR_MEMORY, "NVML_ERROR_MEMORY", "Insufficient Memory"},
    {NVML_ERROR_NO_DATA, "NVML_ERROR_NO_DATA", "No data"},
    {NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", "Argument version mismatch"},
    {NVML_ERROR_UNKNOWN, "NVML_ERROR_UNKNOWN", "Unknown Error"},
};

/* A thread whose NVML calls stand for another process's (fake_set_nvml_for_another_process): the engine's
 * NVML reader, which tests answer from this process because only here is the machine they set up. */
static __thread int nvml_for_another_process;

/* NVML calls of a process that is not RUNNING block as its CUDA calls do (fact `locked-process-blocks-cuda`;
 * engine/nvml.py reads through another process meanwhile, fact `nvml-reader-process`), with the same
 * timeout and deadlock report; what the real NVML never returns is NVML_ERROR_TIMEOUT here. */
static nvmlReturn_t nvml_wait_until_running(const char *function) {
  if (nvml_for_another_process) return NVML_SUCCESS;
  return wait_until_running(function) == CUDA_SUCCESS ? NVML_SUCCESS : NVML_ERROR_TIMEOUT;
}

static nvmlReturn_t nvml_ready(const char *function) {
  const nvmlReturn_t blocked = nvml_wait_until_running(function);
  if (blocked != NVML_SUCCESS) return blocked;
  return fake.nvml_refcount > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

static nvmlReturn_t nvml_device(const char *function, nvmlDevice_t device, int *index) {
  const nvmlReturn_t ready = nvml_ready(function);
  if (ready != NVML_SUCCESS) return ready;
  if (device < &fake.gpus[0] || device >= &fake.gpus[fake.gpu_count]) return NVML_ERROR_INVALID_ARGUMENT;
  *index = (int)(device - &fake.gpus[0]);
  return NVML_SUCCESS;
}

static nvmlReturn_t copy_text(char *out, unsigned int length, const char *text) {
  if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  if (strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
  memcpy(out, text, strlen(text) + 1);
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
  static const char fn[] = "nvmlInitWithFlags";
  int rc;
  (void)flags;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_wait_until_running(fn);
  if (rc == NVML_SUCCESS) ++fake.nvml_refcount;
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
  static const char fn[] = "nvmlShutdown";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_ready(fn);
  if (rc == NVML_SUCCESS) --fake.nvml_refcount;
  return leave(fn, rc, -1);
}

const char *nvmlErrorString(nvmlReturn_t result) {
  for (size_t i = 0; i < sizeof(nvml_errors) / sizeof(nvml_errors[0]); ++i) {
    if (nvml_errors[i].code == result) return nvml_errors[i].text;
  }
  return "Unknown Error";
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
  static const char fn[] = "nvmlSystemGetDriverVersion";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_ready(fn);
  if (rc == NVML_SUCCESS) rc = copy_text(version, length, fake.nvml_driver);
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
  static const char fn[] = "nvmlSystemGetNVMLVersion";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  char text[96];
  snprintf(text, sizeof(text), "%d.%s", fake.cuda_version / 1000, fake.nvml_driver);
  rc = nvml_ready(fn);
  if (rc == NVML_SUCCESS) rc = copy_text(version, length, text);
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) {
  static const char fn[] = "nvmlSystemGetCudaDriverVersion_v2";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_ready(fn);
  if (rc == NVML_SUCCESS && version == NULL) rc = NVML_ERROR_INVALID_ARGUMENT;
  if (rc == NVML_SUCCESS) *version = fake.cuda_version;
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) { return nvmlSystemGetCudaDriverVersion_v2(version); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
  static const char fn[] = "nvmlDeviceGetCount_v2";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_ready(fn);
  if (rc == NVML_SUCCESS && count == NULL) rc = NVML_ERROR_INVALID_ARGUMENT;
  if (rc == NVML_SUCCESS) *count = (unsigned int)fake.gpu_count;
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
  static const char fn[] = "nvmlDeviceGetHandleByIndex_v2";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_ready(fn);
  if (rc == NVML_SUCCESS && (device == NULL || index >= (unsigned int)fake.gpu_count)) {
    rc = NVML_ERROR_INVALID_ARGUMENT;
  }
  if (rc == NVML_SUCCESS) *device = &fake.gpus[index];
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
  return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
  static const char fn[] = "nvmlDeviceGetHandleByUUID";
  int rc;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_ready(fn);
  if (rc == NVML_SUCCESS && (uuid == NULL || device == NULL)) rc = NVML_ERROR_INVALID_ARGUMENT;
  if (rc == NVML_SUCCESS) {
    rc = NVML_ERROR_NOT_FOUND;
    for (int i = 0; i < fake.gpu_count; ++i) {
      if (strcmp(fake.gpus[i].uuid_text, uuid) == 0) {
        *device = &fake.gpus[i];
        rc = NVML_SUCCESS;
      }
    }
  }
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
  static const char fn[] = "nvmlDeviceGetIndex";
  int rc, i = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_device(fn, device, &i);
  if (rc == NVML_SUCCESS && index == NULL) rc = NVML_ERROR_INVALID_ARGUMENT;
  if (rc == NVML_SUCCESS) *index = (unsigned int)i;
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
  static const char fn[] = "nvmlDeviceGetUUID";
  int rc, i = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_device(fn, device, &i);
  if (rc == NVML_SUCCESS) rc = copy_text(uuid, length, fake.gpus[i].uuid_text);
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
  static const char fn[] = "nvmlDeviceGetName";
  int rc, i = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_device(fn, device, &i);
  if (rc == NVML_SUCCESS) rc = copy_text(name, length, fake.gpus[i].name);
  return leave(fn, rc, -1);
}

/* NVML's v1 view: the driver's reserve is in `used`. */
static void memory_of(int physical, unsigned long long *total, unsigned long long *used, unsigned long long *free_bytes) {
  const struct gpu *g = &fake.gpus[physical];
  unsigned long long in_use = fake.reserved_bytes + others_on(physical) + process_bytes_on(physical);
  if (in_use > g->total) in_use = g->total;
  *total = g->total;
  *used = in_use;
  *free_bytes = g->total - in_use;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
  static const char fn[] = "nvmlDeviceGetMemoryInfo";
  int rc, i = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_device(fn, device, &i);
  if (rc == NVML_SUCCESS && memory == NULL) rc = NVML_ERROR_INVALID_ARGUMENT;
  if (rc == NVML_SUCCESS) memory_of(i, &memory->total, &memory->used, &memory->free);
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
  static const char fn[] = "nvmlDeviceGetMemoryInfo_v2";
  int rc, i = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_device(fn, device, &i);
  if (rc == NVML_SUCCESS && memory == NULL) rc = NVML_ERROR_INVALID_ARGUMENT;
  if (rc == NVML_SUCCESS && memory->version != NVML_MEMORY_V2_VERSION) rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  if (rc == NVML_SUCCESS) {
    memory_of(i, &memory->total, &memory->used, &memory->free);
    memory->reserved = fake.reserved_bytes < memory->used ? fake.reserved_bytes : memory->used;
    memory->used -= memory->reserved; /* v2: the reserve apart from what processes use */
  }
  return leave(fn, rc, -1);
}

/* Physical view: this process appears on each GPU that holds some of its memory now (nothing
 * while checkpointed), each process of the host directory that says it holds some there as itself,
 * and the memory of other processes this process was told of as one process per GPU. */
static nvmlReturn_t running_processes(int physical, unsigned int *count, nvmlProcessInfo_t *infos) {
  nvmlProcessInfo_t found[2 + MAX_NEIGHBOURS];
  unsigned int n = 0;
  const unsigned long long ours = nvml_process_bytes_on(physical);
  if (ours > 0) {
    found[n].pid = (unsigned int)getpid();
    found[n].usedGpuMemory = ours;
    ++n;
  }
  unsigned int pids[MAX_NEIGHBOURS];
  unsigned long long held[MAX_NEIGHBOURS];
  const int neighbours = neighbours_on(physical, pids, held, MAX_NEIGHBOURS);
  for (int k = 0; k < neighbours && k < MAX_NEIGHBOURS; ++k) {
    found[n].pid = pids[k];
    found[n].usedGpuMemory = held[k];
    ++n;
  }
  const unsigned long long told = told_on(physical);
  if (told > 0) {
    found[n].pid = OTHER_PID_BASE + (unsigned int)physical;
    found[n].usedGpuMemory = told;
    ++n;
  }
  for (unsigned int k = 0; k < n; ++k) found[k].gpuInstanceId = found[k].computeInstanceId = 0xffffffffu;
  if (n == 0) {
    *count = 0;
    return NVML_SUCCESS;
  }
  if (infos == NULL || *count < n) {
    *count = n;
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  memcpy(infos, found, n * sizeof(found[0]));
  *count = n;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
  static const char fn[] = "nvmlDeviceGetComputeRunningProcesses_v3";
  int rc, i = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_device(fn, device, &i);
  if (rc == NVML_SUCCESS && count == NULL) rc = NVML_ERROR_INVALID_ARGUMENT;
  if (rc == NVML_SUCCESS) rc = running_processes(i, count, infos);
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
  return nvmlDeviceGetComputeRunningProcesses_v3(device, count, infos);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                      nvmlProcessInfo_t *infos) {
  static const char fn[] = "nvmlDeviceGetGraphicsRunningProcesses_v3";
  int rc, i = 0;
  (void)infos;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_device(fn, device, &i);
  if (rc == NVML_SUCCESS && count == NULL) rc = NVML_ERROR_INVALID_ARGUMENT;
  if (rc == NVML_SUCCESS) *count = 0;
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
  static const char fn[] = "nvmlDeviceGetUtilizationRates";
  int rc, i = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_device(fn, device, &i);
  if (rc == NVML_SUCCESS && utilization == NULL) rc = NVML_ERROR_INVALID_ARGUMENT;
  if (rc == NVML_SUCCESS) {
    utilization->gpu = fake.gpus[i].util_gpu;
    utilization->memory = fake.gpus[i].util_memory;
  }
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temperature) {
  static const char fn[] = "nvmlDeviceGetTemperature";
  int rc, i = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_device(fn, device, &i);
  if (rc == NVML_SUCCESS && (temperature == NULL || sensor != 0)) rc = NVML_ERROR_INVALID_ARGUMENT;
  if (rc == NVML_SUCCESS) *temperature = fake.gpus[i].temperature_c;
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature) {
  static const char fn[] = "nvmlDeviceGetTemperatureV";
  int rc, i = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_device(fn, device, &i);
  if (rc == NVML_SUCCESS && (temperature == NULL || temperature->sensorType != 0)) rc = NVML_ERROR_INVALID_ARGUMENT;
  if (rc == NVML_SUCCESS && temperature->version != NVML_TEMPERATURE_V1_VERSION) rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  if (rc == NVML_SUCCESS) temperature->temperature = (int)fake.gpus[i].temperature_c;
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
  static const char fn[] = "nvmlDeviceGetPciInfo_v3";
  int rc, i = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_device(fn, device, &i);
  if (rc == NVML_SUCCESS && pci == NULL) rc = NVML_ERROR_INVALID_ARGUMENT;
  if (rc == NVML_SUCCESS) {
    memset(pci, 0, sizeof(*pci));
    const unsigned int bus = fake.gpus[i].bus;
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "0000:%02X:00.0", bus);
    snprintf(pci->busId, sizeof(pci->busId), "00000000:%02X:00.0", bus);
    pci->bus = bus;
    pci->pciDeviceId = 0x233510deu;    /* H200 SXM, NVIDIA's vendor id in the low half */
    pci->pciSubSystemId = 0x18be10deu;
  }
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, int *current, int *pending) {
  static const char fn[] = "nvmlDeviceGetEccMode";
  int rc, i = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_device(fn, device, &i);
  if (rc == NVML_SUCCESS && (current == NULL || pending == NULL)) rc = NVML_ERROR_INVALID_ARGUMENT;
  if (rc == NVML_SUCCESS) *current = *pending = 1;
  return leave(fn, rc, -1);
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType,
                                         unsigned long long *count) {
  static const char fn[] = "nvmlDeviceGetTotalEccErrors";
  int rc, i = 0;
  if (enter(fn, &rc)) return leave(fn, rc, -1);
  rc = nvml_device(fn, device, &i);
  if (rc == NVML_SUCCESS && (count == NULL || errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1)) {
    rc = NVML_ERROR_INVALID_ARGUMENT;
  }
  if (rc == NVML_SUCCESS) *count = errorType == 1 ? fake.gpus[i].ecc_uncorrected : 0;
  return leave(fn, rc, -1);
}

/* ------------------------------------------------------------------ control functions for tests */

void fake_reset(void) {
  pthread_mutex_lock(&mutex);
  reset_locked();
  pthread_mutex_unlock(&mutex);
}

int fake_gpu_count(void) {
  pthread_mutex_lock(&mutex);
  const int n = fake.gpu_count;
  pthread_mutex_unlock(&mutex);
  return n;
}

/* Writes "GPU-..." of a physical GPU into out; 0, or -1 for a bad index. */
int fake_uuid(int physical, char *out, int length) {
  pthread_mutex_lock(&mutex);
  int rc = -1;
  if (physical >= 0 && physical < fake.gpu_count && out != NULL && length > 0) {
    copy_truncated(out, length, fake.gpus[physical].uuid_text);
    rc = 0;
  }
  pthread_mutex_unlock(&mutex);
  return rc;
}

int fake_set_process_memory(int logical, unsigned long long bytes) {
  pthread_mutex_lock(&mutex);
  const int ok = logical >= 0 && logical < fake.gpu_count;
  if (ok) fake.process_bytes[logical] = bytes;
  publish_holdings();
  pthread_mutex_unlock(&mutex);
  return ok ? 0 : -1;
}

void fake_set_peer_access(int allowed) {
  pthread_mutex_lock(&mutex);
  fake.no_peer_access = !allowed;
  pthread_mutex_unlock(&mutex);
}

int fake_set_other_memory(int physical, unsigned long long bytes) {
  pthread_mutex_lock(&mutex);
  const int ok = physical >= 0 && physical < fake.gpu_count;
  if (ok) fake.gpus[physical].other_bytes = bytes;
  pthread_mutex_unlock(&mutex);
  return ok ? 0 : -1;
}

int fake_set_gpu_activity(int physical, unsigned int util_gpu, unsigned int util_memory, unsigned int temperature_c,
                          unsigned long long ecc_uncorrected) {
  pthread_mutex_lock(&mutex);
  const int ok = physical >= 0 && physical < fake.gpu_count;
  if (ok) {
    fake.gpus[physical].util_gpu = util_gpu;
    fake.gpus[physical].util_memory = util_memory;
    fake.gpus[physical].temperature_c = temperature_c;
    fake.gpus[physical].ecc_uncorrected = ecc_uncorrected;
  }
  pthread_mutex_unlock(&mutex);
  return ok ? 0 : -1;
}

int fake_fail(const char *function, int nth, int code) {
  pthread_mutex_lock(&mutex);
  const int rc = add_rule(function, nth, code);
  pthread_mutex_unlock(&mutex);
  return rc;
}

/* The nth next call of a copy function (cuMemcpyDtoDAsync, cuMemcpyDtoHAsync, cuMemcpyHtoDAsync)
 * flips one bit of what it wrote. */
int fake_corrupt_copy(const char *function, int nth) {
  pthread_mutex_lock(&mutex);
  const int rc = add_corruption(function, nth);
  pthread_mutex_unlock(&mutex);
  return rc;
}

void fake_clear_failures(void) {
  pthread_mutex_lock(&mutex);
  fake.rule_count = 0;
  fake.corruption_count = 0;
  pthread_mutex_unlock(&mutex);
}

int fake_pending_failures(void) {
  pthread_mutex_lock(&mutex);
  const int n = fake.rule_count;
  pthread_mutex_unlock(&mutex);
  return n;
}

static int add_delay(const char *function, unsigned int ms) {
  int i = 0;
  while (i < fake.delay_count && strcmp(fake.delays[i].function, function) != 0) ++i;
  if (i == fake.delay_count) {
    if (fake.delay_count == MAX_DELAYS) return -1;
    ++fake.delay_count;
    snprintf(fake.delays[i].function, sizeof(fake.delays[i].function), "%s", function);
  }
  fake.delays[i].ms = ms;
  return 0;
}

int fake_set_delay_ms(const char *function, unsigned int ms) {
  if (function == NULL || *function == '\0') return -1;
  pthread_mutex_lock(&mutex);
  const int rc = add_delay(function, ms);
  pthread_mutex_unlock(&mutex);
  return rc;
}

void fake_set_lock_delay_ms(unsigned int ms) {
  pthread_mutex_lock(&mutex);
  fake.lock_delay_ms = ms;
  pthread_mutex_unlock(&mutex);
}

void fake_set_block_timeout_ms(unsigned int ms) {
  pthread_mutex_lock(&mutex);
  fake.block_timeout_ms = ms;
  pthread_mutex_unlock(&mutex);
}

void fake_set_failed_restore_poisons(int on) {
  pthread_mutex_lock(&mutex);
  fake.failed_restore_poisons = on != 0;
  if (!on) fake.restore_poisoned = 0;
  pthread_mutex_unlock(&mutex);
}

int fake_state(void) {
  pthread_mutex_lock(&mutex);
  const int state = fake.state;
  pthread_mutex_unlock(&mutex);
  return state;
}

/* Puts the process in any state at once (e.g. FAILED, which the fake never enters by itself and
 * leaves by no transition), without the checks of the checkpoint API. */
int fake_force_state(int state) {
  if (state < CU_PROCESS_STATE_RUNNING || state > CU_PROCESS_STATE_FAILED) return -1;
  pthread_mutex_lock(&mutex);
  set_state(state);
  pthread_mutex_unlock(&mutex);
  return 0;
}

int fake_physical_of(int logical) {
  pthread_mutex_lock(&mutex);
  const int physical = logical >= 0 && logical < fake.gpu_count ? fake.placement[logical] : -1;
  pthread_mutex_unlock(&mutex);
  return physical;
}

unsigned long long fake_process_bytes_on(int physical) {
  pthread_mutex_lock(&mutex);
  const unsigned long long bytes = physical >= 0 && physical < fake.gpu_count ? process_bytes_on(physical) : 0;
  pthread_mutex_unlock(&mutex);
  return bytes;
}

/* The calling thread's NVML calls stand for another process's (on) or this one's (off): another
 * process's do not block while this one is frozen. */
void fake_set_nvml_for_another_process(int on) { nvml_for_another_process = on != 0; }

unsigned long long fake_used_bytes(int physical) {
  unsigned long long total = 0, used = 0, free_bytes = 0;
  pthread_mutex_lock(&mutex);
  if (physical >= 0 && physical < fake.gpu_count) memory_of(physical, &total, &used, &free_bytes);
  pthread_mutex_unlock(&mutex);
  return used;
}

int fake_call_count(const char *function) {
  if (function == NULL) return 0;
  pthread_mutex_lock(&mutex);
  const struct counter *c = counter_for(function, 0);
  const int n = c != NULL ? c->count : 0;
  pthread_mutex_unlock(&mutex);
  return n;
}

int fake_last_pairs_count(void) {
  pthread_mutex_lock(&mutex);
  const int n = fake.last_pairs_count;
  pthread_mutex_unlock(&mutex);
  return n;
}

/* Pair i of the last restore, as physical GPU indexes (-1: a UUID of no GPU here). */
int fake_last_pair(int i, int *old_physical, int *new_physical) {
  pthread_mutex_lock(&mutex);
  const int ok = i >= 0 && i < fake.last_pairs_count && i < MAX_GPUS * 4 && old_physical != NULL && new_physical != NULL;
  if (ok) {
    *old_physical = fake.last_pairs_old[i];
    *new_physical = fake.last_pairs_new[i];
  }
  pthread_mutex_unlock(&mutex);
  return ok ? 0 : -1;
}

/* The log of CUDA (cu*) calls, oldest first; it keeps the last LOG_CAPACITY calls. */
int fake_log_size(void) {
  pthread_mutex_lock(&mutex);
  const int n = fake.log_total < LOG_CAPACITY ? (int)fake.log_total : LOG_CAPACITY;
  pthread_mutex_unlock(&mutex);
  return n;
}

long fake_log_dropped(void) {
  pthread_mutex_lock(&mutex);
  const long n = fake.log_total > LOG_CAPACITY ? fake.log_total - LOG_CAPACITY : 0;
  pthread_mutex_unlock(&mutex);
  return n;
}

/* Entry i: the function name (static storage), its result, pair count (-1 where it does not
 * apply) and calling thread; 0, or -1 past the end. */
int fake_log_entry(int i, const char **function, int *result, int *pairs, long *tid) {
  pthread_mutex_lock(&mutex);
  const long size = fake.log_total < LOG_CAPACITY ? fake.log_total : LOG_CAPACITY;
  const int ok = i >= 0 && i < size;
  if (ok) {
    const long first = fake.log_total - size;
    const struct log_entry *e = &fake.log[(first + i) % LOG_CAPACITY];
    if (function != NULL) *function = e->function;
    if (result != NULL) *result = e->result;
    if (pairs != NULL) *pairs = e->pairs;
    if (tid != NULL) *tid = e->tid;
  }
  pthread_mutex_unlock(&mutex);
  return ok ? 0 : -1;
}

void fake_clear_log(void) {
  pthread_mutex_lock(&mutex);
  fake.log_total = 0;
  fake.counter_count = 0;
  fake.last_pairs_count = -1;
  fake.blocked_calls = 0;
  fake.deadlocks = 0;
  pthread_mutex_unlock(&mutex);
}

int fake_blocked_calls(void) {
  pthread_mutex_lock(&mutex);
  const int n = fake.blocked_calls;
  pthread_mutex_unlock(&mutex);
  return n;
}

int fake_deadlocks(void) {
  pthread_mutex_lock(&mutex);
  const int n = fake.deadlocks;
  pthread_mutex_unlock(&mutex);
  return n;
}

int fake_restore_thread_id(void) {
  pthread_mutex_lock(&mutex);
  const int tid = (int)fake.restore_tid;
  pthread_mutex_unlock(&mutex);
  return tid;
}

int fake_nvml_refcount(void) {
  pthread_mutex_lock(&mutex);
  const int n = fake.nvml_refcount;
  pthread_mutex_unlock(&mutex);
  return n;
}

int fake_cuda_version(void) {
  pthread_mutex_lock(&mutex);
  const int v = fake.cuda_version;
  pthread_mutex_unlock(&mutex);
  return v;
}

/* ------------------------------------------------------------------ control functions: VMM */

int fake_vmm_allocations(void) {
  pthread_mutex_lock(&mutex);
  vmm_collect();
  int n = 0;
  for (int i = 0; i < MAX_VMM; ++i) n += vmm.allocs[i].used;
  pthread_mutex_unlock(&mutex);
  return n;
}

static int count_used(const void *table, size_t stride) {
  int n = 0;
  for (int i = 0; i < MAX_VMM; ++i) n += *(const int *)((const char *)table + (size_t)i * stride) != 0;
  return n;
}
#define COUNT_USED(array) count_used((array), sizeof((array)[0]))

int fake_vmm_handles(void) {
  pthread_mutex_lock(&mutex);
  const int n = COUNT_USED(vmm.handles);
  pthread_mutex_unlock(&mutex);
  return n;
}

int fake_vmm_mappings(void) {
  pthread_mutex_lock(&mutex);
  const int n = COUNT_USED(vmm.mappings);
  pthread_mutex_unlock(&mutex);
  return n;
}

int fake_vmm_reservations(void) {
  pthread_mutex_lock(&mutex);
  const int n = COUNT_USED(vmm.reservations);
  pthread_mutex_unlock(&mutex);
  return n;
}

/* VMM bytes on a physical GPU now (fd-held memory included, memory in a checkpoint image not). */
unsigned long long fake_vmm_bytes_on(int physical) {
  pthread_mutex_lock(&mutex);
  vmm_collect();
  const unsigned long long bytes = physical >= 0 && physical < fake.gpu_count ? vmm_bytes_on(physical, 0) : 0;
  pthread_mutex_unlock(&mutex);
  return bytes;
}

unsigned long long fake_pinned_bytes(void) {
  pthread_mutex_lock(&mutex);
  unsigned long long bytes = 0;
  for (int i = 0; i < MAX_VMM; ++i) bytes += vmm.host[i].used ? vmm.host[i].size : 0;
  pthread_mutex_unlock(&mutex);
  return bytes;
}

unsigned long long fake_pinned_at_last_checkpoint(void) {
  pthread_mutex_lock(&mutex);
  const unsigned long long bytes = fake.pinned_at_checkpoint;
  pthread_mutex_unlock(&mutex);
  return bytes;
}

int fake_live_events(void) {
  pthread_mutex_lock(&mutex);
  const int n = vmm.event_count;
  pthread_mutex_unlock(&mutex);
  return n;
}

int fake_live_streams(void) {
  pthread_mutex_lock(&mutex);
  const int n = vmm.stream_count;
  pthread_mutex_unlock(&mutex);
  return n;
}

int fake_primary_ctx_refcount(int device) {
  pthread_mutex_lock(&mutex);
  const int n = device >= 0 && device < MAX_GPUS ? vmm.primary_refs[device] : -1;
  pthread_mutex_unlock(&mutex);
  return n;
}

/* The calling thread's current context, as a device ordinal (-1: none). */
int fake_current_context(void) { return current_context; }

unsigned long long fake_vmm_granularity(void) { return VMM_GRANULARITY; }
