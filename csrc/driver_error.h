// One exception type for every failed driver call, and one macro that raises it.
#pragma once

#include <stdexcept>
#include <string>

#include "cuda_driver_types.h"

namespace flexium {

// "cuMemMap(...) failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory) [vmm.cpp:88]"
class DriverError : public std::runtime_error {
 public:
  DriverError(std::string call, CUresult code, const std::string &detail, const char *file, int line);
  const std::string &call() const { return call_; }
  CUresult code() const { return code_; }
  const std::string &error_name() const { return error_name_; }

 private:
  std::string call_;
  CUresult code_;
  std::string error_name_;
};

// Names a CUresult through the driver when it is loaded, else through our own short table.
std::string error_name(CUresult code);
std::string error_text(CUresult code);

struct DriverTable;
// The loaded and initialised driver, or a DriverError saying why there is none.
const DriverTable &require_driver();

// Throws DriverError when the driver lacks `symbol` (an optional feature function).
void require_symbol(const void *fn, const char *symbol, int version);

}  // namespace flexium

// FLEXIUM_REQUIRE_FUNCTION(d, cuMemMap): require_symbol with the version driver_table.h lists.
#define FLEXIUM_REQUIRE_FUNCTION(table, function)                                        \
  ::flexium::require_symbol(reinterpret_cast<const void *>((table).function), #function, \
                            ::flexium::driver_versions::function)

// FLEXIUM_CU_CALL(d, cuDeviceGetCount, &count): calls d.cuDeviceGetCount(&count) and throws a
// DriverError whose .call is the bare function name.
#define FLEXIUM_CU_CALL(table, function, ...)                                           \
  do {                                                                                  \
    const CUresult flexium_result_ = (table).function(__VA_ARGS__);                     \
    if (flexium_result_ != CUDA_SUCCESS) {                                              \
      throw ::flexium::DriverError(#function, flexium_result_, "", __FILE__, __LINE__); \
    }                                                                                   \
  } while (0)
