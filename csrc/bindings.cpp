// Glue only: every function here forwards to one file of csrc/, and every struct crosses as
// itself (a bound class), never as a tuple.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <string>

#include "checkpoint.h"
#include "devices.h"
#include "driver_error.h"
#include "driver_table.h"
#include "gpu_memory_yield.h"
#include "host_copier.h"
#include "move_checksum.h"
#include "slow_call_report.h"
#include "uncheckpointable_memory.h"
#include "vmm_allocator.h"
#include "vmm_driver.h"
#include "vmm_host_staging.h"
#include "vmm_registry.h"
#include "vmm_relocate.h"

namespace py = pybind11;
using namespace flexium;

namespace {

using release_gil = py::call_guard<py::gil_scoped_release>;

// "Name(field=value, ...)" of a bound struct, over its class's properties in the order they were bound.
std::string record_repr(py::handle self) {
  const py::handle cls = py::type::handle_of(self);
  const py::handle property_type = reinterpret_cast<PyObject *>(&PyProperty_Type);
  std::string text = std::string(py::str(cls.attr("__name__"))) + "(";
  const char *separator = "";
  for (const py::handle item : cls.attr("__dict__").attr("items")()) {
    const auto entry = py::reinterpret_borrow<py::tuple>(item);
    if (!py::isinstance(entry[1], property_type)) continue;
    const std::string name = py::str(entry[0]);
    text += separator + name + "=" + std::string(py::repr(self.attr(name.c_str())));
    separator = ", ";
  }
  return text + ")";
}

// flexium.errors.DriverError (a FlexiumError), raised for every C++ DriverError. Pure Python
// on purpose: importing it needs neither a driver nor torch.
void bind_driver(py::module_ &m) {
  static py::handle driver_error = py::object(py::module_::import("flexium.errors").attr("DriverError")).release();
  m.attr("DriverError") = driver_error;
  py::register_local_exception_translator([](std::exception_ptr pending) {
    try {
      if (pending) std::rethrow_exception(pending);
    } catch (const DriverError &e) {
      py::object instance = driver_error(e.what(), py::arg("call") = e.call(), py::arg("code") = e.code(),
                                         py::arg("error_name") = e.error_name());
      PyErr_SetObject(driver_error.ptr(), instance.ptr());
    }
  });

  py::class_<DriverStatus>(m, "DriverStatus")
      .def_readonly("loaded", &DriverStatus::loaded)
      .def_readonly("library", &DriverStatus::library)
      .def_readonly("error", &DriverStatus::error)
      .def_readonly("cuda_version", &DriverStatus::cuda_version)
      .def_readonly("init_error", &DriverStatus::init_error)
      .def_readonly("checkpoint_api", &DriverStatus::checkpoint_api)
      .def_readonly("vmm_api", &DriverStatus::vmm_api)
      .def_readonly("checksum_api", &DriverStatus::checksum_api)
      .def_readonly("missing_optional", &DriverStatus::missing_optional)
      .def("__repr__", &record_repr);
  m.def("driver_status", &driver_status, "Whether the driver loaded, its CUDA version and missing features.");
  m.attr("CHECKPOINT_API_VERSION") = kCheckpointApiVersion;
}

void bind_devices(py::module_ &m) {
  py::class_<DeviceInfo>(m, "DeviceInfo")
      .def_readonly("ordinal", &DeviceInfo::ordinal)
      .def_readonly("uuid", &DeviceInfo::uuid)
      .def_readonly("name", &DeviceInfo::name)
      .def_readonly("total_memory", &DeviceInfo::total_memory)
      .def_readonly("pci_bus_id", &DeviceInfo::pci_bus_id)
      .def("__repr__", &record_repr);
  m.def("list_devices", &list_devices, release_gil(), "GPUs this process sees, as the driver reports them now.");
}

void bind_checkpoint(py::module_ &m) {
  // py::enum_, not py::native_enum: a native_enum of pybind11 3.1 loaded before torch 2.11 makes
  // `import torch` crash (fact `extension-loads-before-torch`).
  py::enum_<CUprocessState>(m, "ProcessState")
      .value("RUNNING", CU_PROCESS_STATE_RUNNING)
      .value("LOCKED", CU_PROCESS_STATE_LOCKED)
      .value("CHECKPOINTED", CU_PROCESS_STATE_CHECKPOINTED)
      .value("FAILED", CU_PROCESS_STATE_FAILED);

  py::class_<GpuPair>(m, "GpuPair")
      .def(py::init<std::string, std::string>(), py::arg("old_uuid"), py::arg("new_uuid"))
      .def_readonly("old_uuid", &GpuPair::old_uuid)
      .def_readonly("new_uuid", &GpuPair::new_uuid)
      .def("__repr__", &record_repr);

  m.def("process_state", &process_state, py::arg("pid"), release_gil());
  m.def("restore_thread_id", &restore_thread_id, py::arg("pid"), release_gil());
  m.def("lock", &lock_process, py::arg("pid"), py::arg("timeout_ms"), release_gil());
  m.def("checkpoint", &checkpoint_process, py::arg("pid"), release_gil());
  m.def("restore", &restore_process, py::arg("pid"), py::arg("pairs") = std::vector<GpuPair>{}, release_gil());
  m.def("unlock", &unlock_process, py::arg("pid"), release_gil());
  m.def("driver_call_report_setting", &driver_call_report_setting,
        "FLEXIUM_DRIVER_CALL_REPORT_S: seconds between reports of a checkpoint call that has not returned "
        "(60 when unset); 0 when it is not a whole number of seconds from 1 to 86400.");

  py::class_<UncheckpointableMapping>(m, "UncheckpointableMapping")
      .def_readonly("address", &UncheckpointableMapping::address)
      .def_readonly("size", &UncheckpointableMapping::size)
      .def_readonly("kind", &UncheckpointableMapping::kind)
      .def_readonly("location", &UncheckpointableMapping::location)
      .def("__repr__", &record_repr);
  m.def("uncheckpointable_mappings", py::overload_cast<>(&uncheckpointable_mappings), release_gil(),
        "This process's mappings of memory the driver's checkpoint cannot carry: managed, and host cuMem.");

  py::enum_<StepKind>(m, "StepKind")
      .value("LOCK", StepKind::Lock)
      .value("CHECKPOINT", StepKind::Checkpoint)
      .value("RESTORE", StepKind::Restore)
      .value("UNLOCK", StepKind::Unlock)
      .value("RECOVER", StepKind::Recover)
      .value("ROOM_CHECK", StepKind::RoomCheck);
  py::class_<Step>(m, "Step")
      .def(py::init(&make_step), py::arg("kind"), py::arg("timeout_ms") = 0, py::arg("pairs") = std::vector<GpuPair>{})
      .def_property_readonly("kind", [](const Step &s) { return s.kind; })
      .def_property_readonly("pair_count", [](const Step &s) { return s.pairs.size(); })
      .def("__repr__", &record_repr);
  m.def(
      "room_check_step",
      [](int request_fd, int reply_fd, const std::string &uuid, unsigned long long needed, unsigned timeout_ms) {
        RoomQuery room;
        room.request_fd = request_fd;
        room.reply_fd = reply_fd;
        room.uuid = uuid;
        room.needed = needed;
        room.timeout_ms = timeout_ms;
        return make_room_step(room);
      },
      py::arg("request_fd"), py::arg("reply_fd"), py::arg("uuid"), py::arg("needed"), py::arg("timeout_ms") = 2000,
      "A step that asks the NVML reader (its pipes' fds) for the GPU's free memory and fails when it is less than "
      "`needed`; an answer it cannot get passes, as before the check (csrc/room_check.h).");
  py::class_<StepOutcome>(m, "StepOutcome")
      .def_readonly("step", &StepOutcome::step)
      .def_readonly("rollback", &StepOutcome::rollback)
      .def_readonly("code", &StepOutcome::code)
      .def_readonly("error_name", &StepOutcome::error_name)
      .def_readonly("error_text", &StepOutcome::error_text)
      .def_readonly("seconds", &StepOutcome::seconds)
      .def("__repr__", &record_repr);
  m.def(
      "run_steps",
      [](int pid, const std::vector<Step> &steps, const std::vector<std::vector<Step>> &rollbacks, bool hold_gil) {
        if (hold_gil) return run_steps(pid, steps, rollbacks);
        py::gil_scoped_release release;
        return run_steps(pid, steps, rollbacks);
      },
      py::arg("pid"), py::arg("steps"), py::arg("rollbacks"), py::arg("hold_gil") = false,
      "Runs the steps in order; on failure of step i runs rollbacks[i] and stops. Never raises for a "
      "failed step: the outcomes say what happened. hold_gil keeps every other Python thread out of CUDA "
      "until the caller has mapped its segments back (the fast path).");
}

void bind_allocator(py::module_ &m) {
  py::class_<SegmentInfo>(m, "SegmentInfo")
      .def_readonly("address", &SegmentInfo::address)
      .def_readonly("size", &SegmentInfo::size)
      .def_readonly("device", &SegmentInfo::device)
      .def_readonly("mapped", &SegmentInfo::mapped)
      .def("__repr__", &record_repr);

  m.def(
      "vmm_granularity", [](int device) { return granularity(require_vmm_driver(), device); }, py::arg("device"),
      release_gil(), "Bytes every segment of the device is rounded up to.");
  m.def("vmm_segments", &list_segments, release_gil(), "Every segment of the allocator, by address.");
  m.def("vmm_bytes_on", &segment_bytes_on, py::arg("device"), release_gil());
  m.def("vmm_segment_count", &segment_count, release_gil());
  m.def("vmm_unknown_frees", &unknown_free_count, "Frees of pointers the allocator never handed out.");
  m.def("vmm_last_error", &vmm_last_error, "This thread's last allocator failure, \"\" if none.");
  m.def("open_pool_to_current_users", &open_pool_to_current_users, release_gil(),
        "Opens the pool to the GPUs the process has begun to use (their context active); returns how many.");
  m.def("vmm_imported_count", &imported_segment_count, release_gil());
  m.def("vmm_segments_to_own", &segments_to_own_count, release_gil(),
        "Segments own_imported replaces: imported, or left unexportable by a driver restore.");
  m.def("vmm_mark_restored_by_driver", &mark_restored_by_driver, release_gil(),
        "After a driver restore: the segments mapped now are no longer exportable; returns how many.");
  m.def("set_gpu_memory_yielder", &set_gpu_memory_yielder, py::arg("pid"),
        "The process the allocator kills when the job runs out of GPU memory (0: none).");
  m.def("gpu_memory_yielder", &gpu_memory_yielder);
  m.def("gpu_memory_yields", &gpu_memory_yields, "How many times an allocation killed the yielder for memory.");
}

// The relocation functions keep the GIL on purpose: the fast path runs them at a safe point and
// no other Python thread may launch work on a segment while its backing is moved.
void bind_relocation(py::module_ &m) {
  py::class_<StagedSegment>(m, "StagedSegment")
      .def(py::init<CUdeviceptr, std::size_t, int>(), py::arg("address"), py::arg("size"), py::arg("fd"))
      .def_readonly("address", &StagedSegment::address)
      .def_readonly("size", &StagedSegment::size)
      .def_readonly("fd", &StagedSegment::fd)
      .def_readonly("checksum", &StagedSegment::checksum)
      .def("__repr__", &record_repr);

  m.def("stage_segments_to_device", &stage_segments_to_device, py::arg("target"), py::arg("source") = -1,
        py::arg("live") = LiveRanges{}, py::arg("only") = SegmentFilter{}, py::arg("checksum_copies") = false,
        "Copies the segments to the target device (only the live ranges of those listed in `live`); the "
        "returned fds are the caller's. With checksum_copies, each copy's checksum where it landed.");
  m.def("last_staged_copy_bytes", &last_staged_copy_bytes, "Bytes the last stage_segments_to_device copied.");
  m.def("last_staged_checksum_seconds", &last_staged_checksum_seconds,
        "Seconds the last stage_segments_to_device spent on its copies' checksums.");
  m.def("release_source_backing", &release_source_backing, py::arg("source") = -1, py::arg("only") = SegmentFilter{});
  m.def("map_imported", &map_imported, py::arg("staged"), py::arg("device"));
  m.def("own_imported", &own_imported, py::arg("device"), py::arg("live") = LiveRanges{},
        py::arg("max_bytes") = SIZE_MAX,
        "Replaces imported segment memory with memory of our own (a checkpoint cannot restore imported memory), "
        "stopping once max_bytes are replaced; returns the bytes replaced.");
}

// The moves' checksum (move_checksum.h), with the GIL held like the moves it checks.
void bind_checksum(py::module_ &m) {
  py::class_<ChecksumRange>(m, "ChecksumRange")
      .def(py::init<CUdeviceptr, std::size_t, std::uint64_t>(), py::arg("address"), py::arg("length"),
           py::arg("first_word"))
      .def_readonly("address", &ChecksumRange::address)
      .def_readonly("length", &ChecksumRange::length)
      .def_readonly("first_word", &ChecksumRange::first_word)
      .def("__repr__", &record_repr);
  m.def("checksum_ranges", &checksum_ranges, py::arg("device"), py::arg("ranges"),
        "The checksum of each range's bytes, computed on `device` by the PTX kernel.");
  m.def("segment_checksums", &segment_checksums, py::arg("device"), py::arg("live") = LiveRanges{},
        "The checksum of each backed segment of `device` over its live ranges (whole segments where not listed).");
  m.def("load_checksum_kernel", &load_checksum_kernel, py::arg("device"), release_gil(),
        "Loads the kernel into `device`'s context ahead of a move (the driver compiles it then).");
}

void bind_host_staging(py::module_ &m) {
  m.def("reserve_host_staging", &reserve_host_staging, py::arg("bytes"), py::arg("device"),
        py::arg("chunk_bytes") = kDefaultHostChunkBytes, py::arg("pin_here") = true, py::arg("job_stopped") = false,
        release_gil(),
        "Maps, touches and (pin_here) pins host staging for `bytes` ahead of a pause; returns the bytes pinned by "
        "this call. job_stopped: the job waits at its safe point, so more files (touching threads) are made.");
  m.def("stage_segments_to_host", &stage_segments_to_host, py::arg("live") = LiveRanges{},
        py::arg("chunk_bytes") = kDefaultHostChunkBytes,
        "Copies the segments (only the live ranges of those listed) into host staging; returns the bytes copied.");
  m.def("restore_segments_from_host", &restore_segments_from_host, py::arg("device") = -1);
  m.def("restage_released_segments", &restage_released_segments,
        "Segments brought back from the staging and released again wait in it again; returns how many.");
  m.def("release_host_staging", &release_host_staging, py::arg("keep_driver_made") = false, release_gil());
  m.def("set_host_release_hurried", &set_host_release_hurried, py::arg("hurried"),
        "While true, a release_host_staging under way drops what is left at once, a thread per extent.");
  m.def("host_staging_pool_bytes", &host_staging_pool_bytes, release_gil());
  m.def("host_staging_pinned_bytes", &host_staging_pinned_bytes, release_gil());
  m.def("host_staged_segments", &host_staged_segments, release_gil());
}

void bind_copier(py::module_ &m) {
  py::class_<CopierChunk>(m, "CopierChunk")
      .def(py::init<std::size_t, std::size_t, std::size_t>(), py::arg("extent"), py::arg("offset"), py::arg("size"))
      .def_readonly("extent", &CopierChunk::extent)
      .def_readonly("offset", &CopierChunk::offset)
      .def_readonly("size", &CopierChunk::size)
      .def("__repr__", &record_repr);

  py::class_<CopierPiece>(m, "CopierPiece")
      .def(py::init<std::size_t, std::size_t, std::size_t, std::size_t, std::size_t>(), py::arg("segment"),
           py::arg("segment_offset"), py::arg("chunk"), py::arg("chunk_offset"), py::arg("length"))
      .def_readonly("segment", &CopierPiece::segment)
      .def_readonly("segment_offset", &CopierPiece::segment_offset)
      .def_readonly("chunk", &CopierPiece::chunk)
      .def_readonly("chunk_offset", &CopierPiece::chunk_offset)
      .def_readonly("length", &CopierPiece::length)
      .def("__repr__", &record_repr);

  py::class_<HostStagingLayout>(m, "HostStagingLayout")
      .def_readonly("extents", &HostStagingLayout::extents)
      .def_readonly("chunks", &HostStagingLayout::chunks)
      .def_readonly("driver_made", &HostStagingLayout::driver_made)
      .def("__repr__", &record_repr);

  py::class_<HostOrder>(m, "HostOrder")
      .def_readonly("segments", &HostOrder::segments)
      .def_readonly("pieces", &HostOrder::pieces)
      .def_readonly("bytes", &HostOrder::bytes)
      .def("__repr__", &record_repr);

  m.def("host_staging_layout", &host_staging_layout,
        "The staging's extents (memfd or driver-made host memory, size), its own fds, chunks, and which are "
        "driver-made.");
  m.def("adopt_host_memory", &adopt_host_memory, py::arg("allocations"), release_gil(),
        "Adds host memory the driver made in the copier ((fd, size) each: the fds become the staging's) to the "
        "staging; returns its bytes.");
  // The orders keep the GIL, like the in-process moves: no other thread may touch the segments.
  m.def(
      "begin_stage_order", [](const LiveRanges &live) { return begin_stage_order(live); },
      py::arg("live") = LiveRanges{},
      "Lays the segments out over the staging for the copier; the order's fds stay the order's. Holds the "
      "segment lock until finish_host_order() or abort_host_order().");
  m.def("begin_restore_order", &begin_restore_order, py::arg("device") = -1,
        "New memory for the staged segments, for the copier to fill: like begin_stage_order.");
  m.def("finish_host_order", &finish_host_order);
  m.def("abort_host_order", &abort_host_order);

  py::class_<FillSegment>(m, "FillSegment")
      .def_readonly("address", &FillSegment::address)
      .def_readonly("size", &FillSegment::size)
      .def_readonly("serial", &FillSegment::serial)
      .def("__repr__", &record_repr);

  py::class_<FillOrder>(m, "FillOrder")
      .def_readonly("segments", &FillOrder::segments)
      .def_readonly("pieces", &FillOrder::pieces)
      .def_readonly("bytes", &FillOrder::bytes)
      .def("__repr__", &record_repr);

  m.def("plan_fill_order", &plan_fill_order,
        "The staged segments and their pieces, for the copier to fill new memory with while the driver restores.");
  m.def("adopt_filled_segments", &adopt_filled_segments, py::arg("order"), py::arg("fds"), py::arg("device"),
        "Maps the copier's filled memory (one fd per segment of the order, all closed) at the segments' addresses "
        "for `device`; returns the bytes of the segments mapped.");

  m.def(
      "default_write_buffer_bytes", [] { return kDefaultWriteBufferBytes; },
      "Bytes of each pinned buffer a copier writes a staging through unless set (csrc/host_copier.h says why).");
  m.def("write_buffer_refusal", &write_buffer_refusal, py::arg("bytes"),
        "Why a write buffer of that many bytes cannot be used, or an empty string where it can.");

  py::class_<HostCopier>(m, "HostCopier")
      .def(py::init<const std::vector<std::pair<int, std::size_t>> &, const std::vector<CopierChunk> &,
                    const std::vector<bool> &, const std::vector<bool> &>(),
           py::arg("extents"), py::arg("chunks"), py::arg("driver_made") = std::vector<bool>{},
           py::arg("written") = std::vector<bool>{})
      .def("extend", &HostCopier::extend, py::arg("extents"), py::arg("chunks"),
           py::arg("driver_made") = std::vector<bool>{}, py::arg("written") = std::vector<bool>{}, release_gil())
      .def("make_host_memory", &HostCopier::make_host_memory, py::arg("bytes"), py::arg("piece"), release_gil())
      .def("wake", &HostCopier::wake, py::arg("uuid"), py::arg("wait"), py::arg("pause_ms") = 0, release_gil())
      .def("copy", &HostCopier::copy, py::arg("to_host"), py::arg("segments"), py::arg("pieces"),
           py::arg("write_untouched") = false, release_gil())
      .def("fill", &HostCopier::fill, py::arg("sizes"), py::arg("pieces"), release_gil())
      .def("pin_rest", &HostCopier::pin_rest, py::arg("pause_ms"), release_gil())
      .def("sleep", &HostCopier::sleep, release_gil())
      .def_property_readonly("awake", &HostCopier::awake)
      .def_property_readonly("pinned_bytes", &HostCopier::pinned_bytes)
      .def_property_readonly("pinned_since_wake", &HostCopier::pinned_since_wake)
      .def_property_readonly("pinned_at_wake", &HostCopier::pinned_at_wake)
      .def_property_readonly("pinning", &HostCopier::pinning)
      .def_property_readonly("last_pinner", &HostCopier::last_pinner)
      .def("set_write_buffer_bytes", &HostCopier::set_write_buffer_bytes, py::arg("bytes"))
      .def_property_readonly("write_buffer_bytes", &HostCopier::write_buffer_bytes)
      .def_property_readonly("last_copy_times", [](const HostCopier &c) {
        const CopyTimes t = c.last_copy_times();
        return std::map<std::string, double>{{"import_s", t.import_s},
                                             {"pin_s", t.pin_s},
                                             {"touch_wait_s", t.touch_wait_s},
                                             {"pinned_in_copy", static_cast<double>(t.pinned_in_copy)},
                                             {"copy_s", t.copy_s},
                                             {"written", static_cast<double>(t.written)}};
      });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "flexium's native layer: the CUDA driver resolved at run time, its checkpoint API and the VMM "
      "allocator.";
  bind_driver(m);
  bind_devices(m);
  bind_checkpoint(m);
  bind_allocator(m);
  bind_relocation(m);
  bind_checksum(m);
  bind_host_staging(m);
  bind_copier(m);
}
