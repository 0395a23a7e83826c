#include "driver_table.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "driver_error.h"

namespace flexium {
namespace {

typedef CUresult (*PFN_cuGetProcAddress_legacy)(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);

struct Resolver {
  PFN_cuGetProcAddress_v2 v2 = nullptr;
  PFN_cuGetProcAddress_legacy legacy = nullptr;

  void *resolve(const char *symbol, int version) const {
    void *fn = nullptr;
    if (v2 != nullptr) {
      CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
      if (v2(symbol, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS ||
          status != CU_GET_PROC_ADDRESS_SUCCESS) {
        return nullptr;
      }
      return fn;
    }
    if (legacy(symbol, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT) != CUDA_SUCCESS) return nullptr;
    return fn;
  }
};

DriverTable load() {
  DriverTable table;
  const char *override_path = std::getenv("FLEXIUM_LIBCUDA");
  table.library = (override_path != nullptr && *override_path != '\0') ? override_path : "libcuda.so.1";
  // RTLD_GLOBAL: PyTorch's runtime dlopens the same soname and must get this very instance.
  void *handle = dlopen(table.library.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char *why = dlerror();
    table.load_error =
        "no NVIDIA driver: could not load " + table.library + " (" + (why != nullptr ? why : "unknown reason") + ")";
    return table;
  }
  Resolver resolver;
  resolver.v2 = reinterpret_cast<PFN_cuGetProcAddress_v2>(dlsym(handle, "cuGetProcAddress_v2"));
  resolver.legacy = reinterpret_cast<PFN_cuGetProcAddress_legacy>(dlsym(handle, "cuGetProcAddress"));
  auto get_version = reinterpret_cast<PFN_cuDriverGetVersion>(dlsym(handle, "cuDriverGetVersion"));
  if ((resolver.v2 == nullptr && resolver.legacy == nullptr) || get_version == nullptr) {
    table.load_error =
        table.library + " has no cuGetProcAddress/cuDriverGetVersion: driver too old (flexium needs 570+)";
    return table;
  }
  get_version(&table.cuda_version);

  std::string missing_required;
#define FLEXIUM_RESOLVE(name, version, required)                                       \
  table.name = reinterpret_cast<PFN_##name>(resolver.resolve(#name, version));         \
  if (table.name == nullptr) {                                                         \
    if (required) {                                                                    \
      missing_required += (missing_required.empty() ? "" : ", ") + std::string(#name); \
    } else {                                                                           \
      table.missing_optional.emplace_back(#name);                                      \
    }                                                                                  \
  }
  FLEXIUM_DRIVER_FUNCTIONS(FLEXIUM_RESOLVE)
#undef FLEXIUM_RESOLVE

  if (!missing_required.empty()) {
    table.load_error = table.library + " (CUDA " + std::to_string(table.cuda_version) +
                       ") lacks required functions: " + missing_required;
    return table;
  }
  table.init_result = table.cuInit(0);
  table.loaded = true;
  return table;
}

}  // namespace

const DriverTable &driver() {
  static std::once_flag once;
  static DriverTable table;
  std::call_once(once, [] { table = load(); });
  return table;
}

// `&& d.name != nullptr` for each function of a list.
#define FLEXIUM_AND_RESOLVED(name, version, required) &&d.name != nullptr

bool has_checkpoint_api() {
  const DriverTable &d = driver();
  return d.loaded FLEXIUM_CHECKPOINT_FUNCTIONS(FLEXIUM_AND_RESOLVED);
}

bool has_vmm_api() {
  const DriverTable &d = driver();
  return d.loaded FLEXIUM_VMM_FUNCTIONS(FLEXIUM_AND_RESOLVED);
}

bool has_checksum_api() {
  const DriverTable &d = driver();
  return d.loaded FLEXIUM_CHECKSUM_FUNCTIONS(FLEXIUM_AND_RESOLVED);
}

#undef FLEXIUM_AND_RESOLVED

DriverStatus driver_status() {
  const DriverTable &d = driver();
  DriverStatus status;
  status.loaded = d.loaded;
  status.library = d.library;
  if (!d.loaded) status.error = d.load_error;
  status.cuda_version = d.cuda_version;
  if (d.loaded && d.init_result != CUDA_SUCCESS) status.init_error = error_name(d.init_result);
  status.checkpoint_api = has_checkpoint_api();
  status.vmm_api = has_vmm_api();
  status.checksum_api = has_checksum_api();
  status.missing_optional = d.missing_optional;
  return status;
}

}  // namespace flexium
