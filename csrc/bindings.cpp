// Glue only: every function here forwards to one file of csrc/.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "checkpoint.h"
#include "devices.h"
#include "driver_error.h"
#include "driver_table.h"
#include "host_copier.h"
#include "vmm_allocator.h"
#include "vmm_driver.h"
#include "vmm_host_staging.h"
#include "vmm_registry.h"
#include "vmm_relocate.h"

namespace py = pybind11;
using namespace flexium;

namespace {

PyObject *driver_error_type = nullptr;

void translate_driver_error(std::exception_ptr pending) {
  try {
    if (pending) std::rethrow_exception(pending);
  } catch (const DriverError &e) {
    py::object instance = py::reinterpret_borrow<py::object>(driver_error_type)(e.what());
    instance.attr("call") = e.call();
    instance.attr("code") = e.code();
    instance.attr("error_name") = e.error_name();
    PyErr_SetObject(driver_error_type, instance.ptr());
  }
}

py::dict driver_status() {
  const DriverTable &d = driver();
  py::dict status;
  status["loaded"] = d.loaded;
  status["library"] = d.library;
  status["error"] = d.loaded ? py::none() : py::cast(d.load_error);
  status["cuda_version"] = d.cuda_version;
  status["init_error"] = (!d.loaded || d.init_result == CUDA_SUCCESS) ? py::none() : py::cast(error_name(d.init_result));
  status["checkpoint_api"] = has_checkpoint_api();
  status["vmm_api"] = has_vmm_api();
  status["missing_optional"] = d.missing_optional;
  return status;
}

// (address, size, fd) tuples on the Python side: Python wraps them in its own dataclasses.
using StagedTuple = std::tuple<unsigned long long, std::size_t, int>;

std::vector<StagedTuple> staged_to_tuples(const std::vector<StagedSegment> &staged) {
  std::vector<StagedTuple> out;
  out.reserve(staged.size());
  for (const StagedSegment &s : staged) out.emplace_back(s.address, s.size, s.fd);
  return out;
}

std::vector<StagedSegment> tuples_to_staged(const std::vector<StagedTuple> &tuples) {
  std::vector<StagedSegment> out;
  out.reserve(tuples.size());
  for (const StagedTuple &t : tuples) out.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t)});
  return out;
}

// Pieces of a copier order as (segment, segment_offset, chunk, chunk_offset, length), chunks as
// (extent, offset, size).
using PieceTuple = std::tuple<std::size_t, std::size_t, std::size_t, std::size_t, std::size_t>;
using ChunkTuple = std::tuple<std::size_t, std::size_t, std::size_t>;
using FdSizes = std::vector<std::pair<int, std::size_t>>;

std::tuple<FdSizes, std::vector<PieceTuple>, std::size_t> order_tuple(const HostOrder &order) {
  std::vector<PieceTuple> pieces;
  pieces.reserve(order.pieces.size());
  for (const CopierPiece &p : order.pieces) {
    pieces.emplace_back(p.segment, p.segment_offset, p.chunk, p.chunk_offset, p.length);
  }
  return {order.segments, pieces, order.bytes};
}

std::vector<CopierPiece> tuples_to_pieces(const std::vector<PieceTuple> &tuples) {
  std::vector<CopierPiece> out;
  out.reserve(tuples.size());
  for (const PieceTuple &t : tuples) {
    out.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t)});
  }
  return out;
}

void bind_copier(py::module_ &m) {
  using release_gil = py::call_guard<py::gil_scoped_release>;
  m.def(
      "host_staging_layout",
      []() {
        const HostStagingLayout layout = host_staging_layout();
        std::vector<ChunkTuple> chunks;
        for (const CopierChunk &c : layout.chunks) chunks.emplace_back(c.extent, c.offset, c.size);
        return std::make_pair(layout.extents, chunks);
      },
      "((memfd, size) of each extent, the staging's own fds; (extent, offset, size) of each chunk).");
  // The orders keep the GIL, like the in-process moves: no other thread may touch the segments.
  m.def(
      "begin_stage_order", [](const LiveRanges &live) { return order_tuple(begin_stage_order(live)); },
      py::arg("live") = LiveRanges{},
      "Lays the segments out over the staging for the copier: ([(fd, size)], [piece], bytes); the fds stay the "
      "order's. Holds the segment lock until finish_host_order() or abort_host_order().");
  m.def(
      "begin_restore_order", [](int device) { return order_tuple(begin_restore_order(device)); },
      py::arg("device") = -1, "New memory for the staged segments, for the copier to fill: like begin_stage_order.");
  m.def("finish_host_order", &finish_host_order);
  m.def("abort_host_order", &abort_host_order);

  py::class_<HostCopier>(m, "HostCopier")
      .def(py::init([](const FdSizes &extents, const std::vector<ChunkTuple> &chunks) {
             std::vector<CopierChunk> specs;
             for (const ChunkTuple &t : chunks) specs.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t)});
             return std::make_unique<HostCopier>(extents, specs);
           }),
           py::arg("extents"), py::arg("chunks"))
      .def("wake", &HostCopier::wake, py::arg("uuid"), py::arg("wait"), py::arg("pause_ms") = 0, release_gil())
      .def(
          "copy",
          [](HostCopier &copier, bool to_host, const FdSizes &segments, const std::vector<PieceTuple> &pieces) {
            const std::vector<CopierPiece> converted = tuples_to_pieces(pieces);
            py::gil_scoped_release release;
            return copier.copy(to_host, segments, converted);
          },
          py::arg("to_host"), py::arg("segments"), py::arg("pieces"))
      .def("sleep", &HostCopier::sleep, release_gil())
      .def_property_readonly("awake", &HostCopier::awake)
      .def_property_readonly("pinned_bytes", &HostCopier::pinned_bytes);
}

std::vector<std::tuple<unsigned long long, std::size_t, int, bool>> segment_tuples() {
  std::vector<std::tuple<unsigned long long, std::size_t, int, bool>> out;
  for (const SegmentInfo &s : list_segments()) out.emplace_back(s.address, s.size, s.device, s.mapped);
  return out;
}

void bind_vmm(py::module_ &m) {
  using release_gil = py::call_guard<py::gil_scoped_release>;
  m.def("vmm_granularity", [](int device) { return granularity(require_vmm_driver(), device); }, py::arg("device"),
        release_gil(), "Bytes every segment of the device is rounded up to.");
  m.def("vmm_segments", &segment_tuples, release_gil(), "(address, size, device, mapped) of every segment, by address.");
  m.def("vmm_bytes_on", &segment_bytes_on, py::arg("device"), release_gil());
  m.def("vmm_segment_count", &segment_count, release_gil());
  m.def("vmm_unknown_frees", &unknown_free_count, "Frees of pointers the allocator never handed out.");
  m.def("vmm_last_error", &vmm_last_error, "This thread's last allocator failure, \"\" if none.");

  m.def(
      "stage_segments_to_device",
      [](int target, int source, const LiveRanges &live, const SegmentFilter &only) {
        return staged_to_tuples(stage_segments_to_device(target, source, live, only));
      },
      py::arg("target"), py::arg("source") = -1, py::arg("live") = LiveRanges{}, py::arg("only") = SegmentFilter{},
      "Copies the segments to the target device (only the live ranges of those listed in `live`); returns "
      "[(address, size, fd)], the fds now the caller's.");
  m.def("last_staged_copy_bytes", &last_staged_copy_bytes, "Bytes the last stage_segments_to_device copied.");
  // The relocation functions keep the GIL on purpose: the fast path runs them at a safe point and
  // no other Python thread may launch work on a segment while its backing is moved.
  m.def("release_source_backing", &release_source_backing, py::arg("source") = -1, py::arg("only") = SegmentFilter{});
  m.def(
      "map_imported",
      [](const std::vector<StagedTuple> &staged, int device) { map_imported(tuples_to_staged(staged), device); },
      py::arg("staged"), py::arg("device"));
  m.def("reserve_host_staging", &reserve_host_staging, py::arg("bytes"), py::arg("device"),
        py::arg("chunk_bytes") = kDefaultHostChunkBytes, py::arg("pin_here") = true, release_gil(),
        "Maps, touches and (pin_here) pins host staging for `bytes` ahead of a pause; returns the bytes pinned by "
        "this call.");
  m.def("own_imported", &own_imported, py::arg("device"), py::arg("live") = LiveRanges{},
        py::arg("max_bytes") = SIZE_MAX,
        "Replaces imported segment memory with memory of our own (a checkpoint cannot restore imported memory), "
        "stopping once max_bytes are replaced; returns the bytes replaced.");
  m.def("vmm_imported_count", &imported_segment_count, release_gil());
  m.def("vmm_segments_to_own", &segments_to_own_count, release_gil(),
        "Segments own_imported replaces: imported, or left unexportable by a driver restore.");
  m.def("vmm_mark_restored_by_driver", &mark_restored_by_driver, release_gil(),
        "After a driver restore: the segments mapped now are no longer exportable; returns how many.");
  m.def("stage_segments_to_host", &stage_segments_to_host, py::arg("live") = LiveRanges{},
        py::arg("chunk_bytes") = kDefaultHostChunkBytes,
        "Copies the segments (only the live ranges of those listed) into host staging; returns the bytes copied.");
  m.def("restore_segments_from_host", &restore_segments_from_host, py::arg("device") = -1);
  m.def("release_host_staging", &release_host_staging, release_gil());
  m.def("host_staging_pool_bytes", &host_staging_pool_bytes, release_gil());
  m.def("host_staging_pinned_bytes", &host_staging_pinned_bytes, release_gil());
  m.def("host_staged_segments", &host_staged_segments, release_gil());
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "flexium's native layer: the CUDA driver resolved at run time, its checkpoint API and the VMM "
            "allocator.";

  static py::exception<DriverError> driver_error(m, "DriverError", PyExc_RuntimeError);
  driver_error_type = driver_error.ptr();
  py::register_exception_translator(&translate_driver_error);

  m.def("driver_status", &driver_status, "Whether the driver loaded, its CUDA version and missing features.");

  py::class_<DeviceInfo>(m, "DeviceInfo")
      .def_readonly("ordinal", &DeviceInfo::ordinal)
      .def_readonly("uuid", &DeviceInfo::uuid)
      .def_readonly("name", &DeviceInfo::name)
      .def_readonly("total_memory", &DeviceInfo::total_memory)
      .def_readonly("pci_bus_id", &DeviceInfo::pci_bus_id);
  m.def("list_devices", &list_devices, py::call_guard<py::gil_scoped_release>(),
        "GPUs this process sees, as the driver reports them now.");

  py::enum_<CUprocessState>(m, "ProcessState")
      .value("RUNNING", CU_PROCESS_STATE_RUNNING)
      .value("LOCKED", CU_PROCESS_STATE_LOCKED)
      .value("CHECKPOINTED", CU_PROCESS_STATE_CHECKPOINTED)
      .value("FAILED", CU_PROCESS_STATE_FAILED);

  py::class_<GpuPair>(m, "GpuPair")
      .def(py::init<std::string, std::string>(), py::arg("old_uuid"), py::arg("new_uuid"))
      .def_readonly("old_uuid", &GpuPair::old_uuid)
      .def_readonly("new_uuid", &GpuPair::new_uuid);

  m.def("process_state", &process_state, py::arg("pid"), py::call_guard<py::gil_scoped_release>());
  m.def("restore_thread_id", &restore_thread_id, py::arg("pid"), py::call_guard<py::gil_scoped_release>());
  m.def("lock", &lock_process, py::arg("pid"), py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>());
  m.def("checkpoint", &checkpoint_process, py::arg("pid"), py::call_guard<py::gil_scoped_release>());
  m.def("restore", &restore_process, py::arg("pid"), py::arg("pairs") = std::vector<GpuPair>{},
        py::call_guard<py::gil_scoped_release>());
  m.def("unlock", &unlock_process, py::arg("pid"), py::call_guard<py::gil_scoped_release>());

  py::enum_<StepKind>(m, "StepKind")
      .value("LOCK", StepKind::Lock)
      .value("CHECKPOINT", StepKind::Checkpoint)
      .value("RESTORE", StepKind::Restore)
      .value("UNLOCK", StepKind::Unlock)
      .value("RECOVER", StepKind::Recover);
  py::class_<Step>(m, "Step")
      .def(py::init(&make_step), py::arg("kind"), py::arg("timeout_ms") = 0,
           py::arg("pairs") = std::vector<GpuPair>{})
      .def_property_readonly("kind", [](const Step &s) { return s.kind; })
      .def_property_readonly("pair_count", [](const Step &s) { return s.pairs.size(); });
  py::class_<StepOutcome>(m, "StepOutcome")
      .def_readonly("step", &StepOutcome::step)
      .def_readonly("rollback", &StepOutcome::rollback)
      .def_readonly("code", &StepOutcome::code)
      .def_readonly("error_name", &StepOutcome::error_name)
      .def_readonly("error_text", &StepOutcome::error_text)
      .def_readonly("seconds", &StepOutcome::seconds);
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

  bind_vmm(m);
  bind_copier(m);
}
