// GPU UUIDs as text ("GPU-" + 8-4-4-4-12 hex digits, nvidia-smi's form) and back.
#pragma once

#include <string>

#include "cuda_driver_types.h"

namespace flexium {

std::string format_uuid(const CUuuid &uuid);
// Accepts "GPU-..." or bare hex, dashes anywhere; throws std::invalid_argument naming the text.
CUuuid parse_uuid(const std::string &text);

}  // namespace flexium
