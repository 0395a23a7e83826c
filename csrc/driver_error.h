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

#define FLEXIUM_CU_CHECK(call_expr)                                                        \
  do {                                                                                     \
    const CUresult flexium_result_ = (call_expr);                                          \
    if (flexium_result_ != CUDA_SUCCESS) {                                                 \
      throw ::flexium::DriverError(#call_expr, flexium_result_, "", __FILE__, __LINE__);   \
    }                                                                                      \
  } while (0)
