// The copier's part of a resume whose copy back runs while the driver restores the job (docs/fast-path.md,
// "Resume: the copy back beside the restore"): the pool's new memory is made here, in the copier's own
// context, filled from the staging and handed to the job as POSIX fds, which it imports after its restore.
//
// Vendor rules relied on:
//  - an allocation made with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among its requestedHandleTypes can be
//    exported as an fd that another process imports with cuMemImportFromShareableHandle and maps (CUDA driver
//    API, Virtual Memory Management: cuMemCreate, cuMemExportToShareableHandle);
//  - the memory is freed only once every mapping is unmapped and every reference to the handle is released,
//    "including its shareable counterparts" (cuMemRelease): the exported fd holds it after the copier
//    releases its handle and mapping (fact `exported-fd-survives-checkpoint` measured it within one process).
//  - another process can copy to the GPU at full rate while the driver restores the job (fact
//    `copy-beside-restore`).
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "driver_error.h"
#include "host_copier.h"
#include "vmm_driver.h"

namespace flexium {

std::vector<int> HostCopier::fill(const std::vector<std::size_t> &sizes, const std::vector<CopierPiece> &pieces) {
  require_awake("cannot fill new memory");
  const DriverTable &d = require_vmm_driver();
  check_pieces(sizes, pieces);
  times_ = CopyTimes{};
  stop_pinner();  // this thread pins what is left, between the copies
  FLEXIUM_CU_CALL(d, cuCtxSetCurrent, context_);
  const auto make_start = std::chrono::steady_clock::now();
  const CUmemAllocationProp prop = device_allocation_prop(ordinal_);
  std::vector<std::unique_ptr<Backing>> made;
  std::vector<CUdeviceptr> addresses;
  made.reserve(sizes.size());
  for (const std::size_t size : sizes) {
    made.push_back(std::make_unique<Backing>(d));
    Backing &b = *made.back();
    b.size = size;
    FLEXIUM_CU_CALL(d, cuMemCreate, &b.handle, size, &prop, 0);
    b.created = true;
    FLEXIUM_CU_CALL(d, cuMemAddressReserve, &b.address, size, 0, 0, 0);
    b.reserved = true;
    FLEXIUM_CU_CALL(d, cuMemMap, b.address, size, 0, b.handle, 0);
    b.mapped = true;
    grant_access(d, b.address, size, {ordinal_});
    addresses.push_back(b.address);
  }
  times_.import_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - make_start).count();
  copy_pieces(/*to_host=*/false, addresses, pieces);
  std::vector<OwnedFd> fds;
  fds.reserve(made.size());
  for (const std::unique_ptr<Backing> &b : made) {
    int fd = -1;
    FLEXIUM_CU_CALL(d, cuMemExportToShareableHandle, &fd, b->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    fds.emplace_back(fd);
  }
  made.clear();  // unmapped and released here; the fds hold the memory now
  std::vector<int> out;
  out.reserve(fds.size());
  for (OwnedFd &fd : fds) out.push_back(fd.release());
  return out;
}

}  // namespace flexium
