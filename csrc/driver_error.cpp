#include "driver_error.h"

#include <cstring>

#include "driver_table.h"

namespace flexium {
namespace {

struct KnownError {
  CUresult code;
  const char *name;
  const char *text;
};

// Used only when no driver is loaded to name its own errors.
constexpr KnownError known_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "timeout occurred"},
};

const KnownError *find_known(CUresult code) {
  for (const KnownError &known : known_errors) {
    if (known.code == code) return &known;
  }
  return nullptr;
}

std::string basename_of(const char *path) {
  const char *slash = std::strrchr(path, '/');
  return slash != nullptr ? slash + 1 : path;
}

std::string format(const std::string &call, CUresult code, const std::string &detail, const char *file, int line) {
  std::string message = call + " failed: " + error_name(code) + " (" + error_text(code) + ")";
  if (!detail.empty()) message += ": " + detail;
  if (file != nullptr) message += " [" + basename_of(file) + ":" + std::to_string(line) + "]";
  return message;
}

}  // namespace

DriverError::DriverError(std::string call, CUresult code, const std::string &detail, const char *file, int line)
    : std::runtime_error(format(call, code, detail, file, line)),
      call_(std::move(call)),
      code_(code),
      error_name_(::flexium::error_name(code)) {}

std::string error_name(CUresult code) {
  const DriverTable &d = driver();
  const char *name = nullptr;
  if (d.loaded && d.cuGetErrorName(code, &name) == CUDA_SUCCESS && name != nullptr) return name;
  const KnownError *known = find_known(code);
  return known != nullptr ? known->name : "CUDA_ERROR_UNKNOWN";
}

std::string error_text(CUresult code) {
  const DriverTable &d = driver();
  const char *text = nullptr;
  if (d.loaded && d.cuGetErrorString(code, &text) == CUDA_SUCCESS && text != nullptr) return text;
  const KnownError *known = find_known(code);
  return known != nullptr ? known->text : "unrecognized error code " + std::to_string(code);
}

const DriverTable &require_driver() {
  const DriverTable &d = driver();
  if (!d.loaded) throw DriverError("dlopen", CUDA_ERROR_NO_DEVICE, d.load_error, nullptr, 0);
  if (d.init_result != CUDA_SUCCESS) throw DriverError("cuInit(0)", d.init_result, "", nullptr, 0);
  return d;
}

void require_symbol(const void *fn, const char *symbol, int version) {
  const DriverTable &d = require_driver();
  if (fn != nullptr) return;
  std::string detail = "the driver (CUDA " + std::to_string(d.cuda_version) + ") does not provide it; it needs CUDA " +
                       std::to_string(version) + "+";
  throw DriverError(symbol, CUDA_ERROR_NOT_FOUND, detail, nullptr, 0);
}

}  // namespace flexium
