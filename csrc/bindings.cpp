// Glue only: every function here forwards to one file of csrc/.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "checkpoint.h"
#include "devices.h"
#include "driver_error.h"
#include "driver_table.h"

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
  status["missing_optional"] = d.missing_optional;
  return status;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "flexium's native layer: the CUDA driver resolved at run time, and its checkpoint API.";

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
  m.def("run_steps", &run_steps, py::arg("pid"), py::arg("steps"), py::arg("rollbacks"),
        py::call_guard<py::gil_scoped_release>(),
        "Runs the steps in order; on failure of step i runs rollbacks[i] and stops. Never raises for a "
        "failed step: the outcomes say what happened.");
}
