"""What the client tells the server about the host's GPUs."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from flexium.client.reports import GpuReading, body_seq, gpu_reports
from flexium.engine.nvml import HostGpu
from flexium.engine.operations import GpuIdentity, OperationKind, OperationResult, StepTiming


def no_gpus() -> GpuReading:
    """A reading of a host where NVML sees no GPU, taken now."""
    return GpuReading(body_seq(), [])


def _gpu(health: str) -> HostGpu:
    return HostGpu(
        index=0,
        uuid="GPU-0",
        name="NVIDIA H200",
        memory_total=100,
        memory_used=10,
        memory_free=90,
        utilization_percent=7,
        temperature_c=40,
        health=health,
        processes=(),
    )


def test_gpu_health_is_reported_as_nvml_says() -> None:
    # "unknown" (NVML cannot read ECC counters) goes out as it is: the server accepts it as a
    # target and shows it as unknown, not as healthy.
    assert [r.health for r in gpu_reports([_gpu("unknown"), _gpu("ok"), _gpu("ecc_errors")])] == [
        "unknown",
        "ok",
        "ecc_errors",
    ]


def test_each_gpu_says_what_the_reporting_process_holds_on_it() -> None:
    """A process may use several GPUs: the server counts its memory on each (and none where
    NVML does not list it)."""
    from flexium.engine.nvml import GpuProcess

    on_two = [replace(_gpu("ok"), uuid=f"GPU-{i}", processes=(GpuProcess(pid=7, used_bytes=5 * i),)) for i in (1, 2)]
    elsewhere = replace(_gpu("ok"), uuid="GPU-3", processes=(GpuProcess(pid=8, used_bytes=4),))
    assert [r.process_bytes for r in gpu_reports([*on_two, elsewhere], pid=7)] == [5, 10, None]
    assert [r.process_bytes for r in gpu_reports(on_two)] == [None, None]


def test_a_failed_engine_is_reported_as_failed() -> None:
    from types import SimpleNamespace

    from flexium.client.reports import ProcessReporter
    from flexium.engine.operations import EngineState

    session = SimpleNamespace(engine=SimpleNamespace(state=EngineState.FAILED))
    assert ProcessReporter(session).state() == "FAILED"  # type: ignore[arg-type]


def test_every_body_carries_a_growing_seq() -> None:
    from types import SimpleNamespace

    from flexium.client.reports import ProcessReporter

    session = SimpleNamespace(engine=None, logical_device="cpu", capabilities=None, process_id="cpu-1", config=None)
    reporter = ProcessReporter(session)  # type: ignore[arg-type]
    seqs = [
        reporter.register_body(no_gpus()).seq,
        reporter.heartbeat_body(no_gpus()).seq,
        reporter.process_update().seq,
        reporter.heartbeat_body(no_gpus()).seq,
    ]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_a_body_is_no_newer_than_the_gpus_it_reports() -> None:
    """GPUs read during an operation (the job's memory nowhere while checkpointed) and sent after its
    final report are older than that report: the server keeps what the report said."""
    from types import SimpleNamespace

    from flexium.client.reports import ProcessReporter

    session = SimpleNamespace(engine=None, logical_device="cpu", capabilities=None, process_id="cpu-1", config=None)
    reporter = ProcessReporter(session)  # type: ignore[arg-type]
    during = no_gpus()
    final = reporter.process_update()
    assert reporter.heartbeat_body(during).seq < final.seq < reporter.heartbeat_body(no_gpus()).seq


def test_the_fast_path_status_goes_out_with_the_capabilities() -> None:
    from types import SimpleNamespace

    from flexium import wire
    from flexium.client.reports import ProcessReporter

    engine = SimpleNamespace(state=None)
    on = SimpleNamespace(active=True, reason_off=None)
    off = SimpleNamespace(active=False, reason_off="switched off (fast_path false, from FLEXIUM_FAST_PATH)")

    def caps(**session: object) -> wire.ProcessCapabilities:
        base = dict(engine=engine, logical_device="cuda:0", capabilities=None, process_id="gpu-1", memory_pool=None)
        return ProcessReporter(SimpleNamespace(**{**base, **session})).capabilities()  # type: ignore[arg-type]

    assert caps(memory_pool=on).fast_path is True
    assert caps(memory_pool=on).fast_path_problem is None
    assert caps(memory_pool=off).fast_path is False
    assert caps(memory_pool=off).fast_path_problem == off.reason_off
    no_pool = caps()
    assert no_pool.fast_path is False and "no CUDA torch" in str(no_pool.fast_path_problem)
    assert caps(engine=None, memory_pool=on).fast_path is False  # no engine: nothing moves


def test_a_process_without_an_engine_says_it_is_on_no_gpu() -> None:
    """A heartbeat's gpu_uuid None means "on no GPU" (no engine): it goes out as null, while a
    field the body leaves out means "unchanged" and does not go out at all. The index and the
    cuda:N shown with it are the server's to derive: they are never sent."""
    from types import SimpleNamespace

    from flexium.client.http import _body
    from flexium.client.reports import ProcessReporter

    session = SimpleNamespace(engine=None, logical_device="cpu", capabilities=None, process_id="cpu-1", config=None)
    sent = _body(ProcessReporter(session).heartbeat_body(no_gpus()))  # type: ignore[arg-type]
    assert sent["gpu_uuid"] is None and "gpu_index" not in sent and "physical_device" not in sent
    assert "footprint_bytes" in sent and "gpu_model" not in sent


def test_a_paused_process_names_the_gpu_it_paused_on() -> None:
    """Paused, the engine still places the job on the GPU it paused from: the server resumes
    it there when it can. visible_gpus is in CUDA ordinal order, what cuda:N means."""
    from types import SimpleNamespace

    from flexium.client.http import _body
    from flexium.client.reports import ProcessReporter
    from flexium.engine.operations import EngineState, GpuIdentity

    gpus = [GpuIdentity(ordinal, f"GPU-{ordinal}", "NVIDIA H200", 1 << 30, "", ordinal) for ordinal in (1, 0)]
    engine = SimpleNamespace(
        state=EngineState.PAUSED, gpus=gpus, placement=lambda: ("cuda:0", gpus[0]), footprint_bytes=lambda: 1 << 20
    )
    session = SimpleNamespace(
        engine=engine, logical_device="cuda:0", capabilities=None, process_id="gpu-1", config=None
    )
    reporter = ProcessReporter(session)  # type: ignore[arg-type]
    beat = _body(reporter.heartbeat_body(no_gpus()))
    assert beat["state"] == "PAUSED" and beat["gpu_uuid"] == "GPU-1" and "physical_device" not in beat
    registered = reporter.register_body(no_gpus())
    assert registered.gpu_uuid == "GPU-1" and registered.visible_gpus == ["GPU-0", "GPU-1"]


def test_the_capabilities_go_out_as_the_keys_they_always_had() -> None:
    """The typed model sends what the dict did, key for key (older servers read it by key)."""
    from types import SimpleNamespace

    from flexium.client.http import _body
    from flexium.client.reports import ProcessReporter
    from flexium.engine.capabilities import Capabilities

    caps = Capabilities(
        driver_version="580.159.04",
        driver_major=580,
        cuda_version=13000,
        checkpoint_api=True,
        torch_cuda=True,
        gpu_count=2,
        pause_resume=True,
        migration=True,
        problems=("one",),
    )
    pool = SimpleNamespace(active=True, reason_off=None)
    session = SimpleNamespace(
        engine=SimpleNamespace(state=None), logical_device="cuda:0", capabilities=caps, memory_pool=pool
    )
    sent = ProcessReporter(session).capabilities().model_dump(mode="json", exclude_unset=True)  # type: ignore[arg-type]
    before = {**caps.to_dict(), "fast_path": True, "fast_path_problem": None}
    assert json.dumps(sent) == json.dumps(before)

    cpu = SimpleNamespace(engine=None, logical_device="cpu", capabilities=None, process_id="cpu-1", config=None)
    body = _body(ProcessReporter(cpu).register_body(no_gpus()))  # type: ignore[arg-type]
    assert list(body["capabilities"]) == ["pause_resume", "migration", "problems", "fast_path", "fast_path_problem"]
    assert body["capabilities"]["pause_resume"] is False and body["capabilities"]["fast_path"] is False
    assert "engine is not running" in body["capabilities"]["problems"][0]


_SOURCE = GpuIdentity(ordinal=0, uuid="GPU-a", name="H200", total_memory=8, pci_bus_id="0:1", nvml_index=3)
_TARGET = GpuIdentity(ordinal=1, uuid="GPU-b", name="H200", total_memory=8, pci_bus_id="0:2", nvml_index=None)
_FAILED_MIGRATION = OperationResult(
    kind=OperationKind.MIGRATE,
    path="fast",
    ok=False,
    logical_device="cuda:0",
    source=_SOURCE,
    target=_TARGET,
    steps=(StepTiming("copy", 0.5, True), StepTiming("restore", 0.25, False, rollback=True, error="e")),
    bytes_moved=1 << 30,
    seconds=1.5,
    failed_step="restore",
    error="CUDA_ERROR_INVALID_VALUE",
    notes=("a note",),
)
_PAUSE = OperationResult(
    kind=OperationKind.PAUSE, path="driver", ok=True, logical_device="cuda:0", source=_SOURCE, target=None
)


def test_an_operation_goes_out_as_its_to_dict_always_did() -> None:
    """The one conversion of the engine's result to the wire sends the JSON ``to_dict()``
    gave, key for key and in order."""
    from flexium import wire
    from flexium.client.http import _body
    from flexium.client.reports import operation_report

    for result in (_FAILED_MIGRATION, _PAUSE):
        report = operation_report(result)
        assert report is not None
        sent = _body(wire.CommandReport(state="failed", result=report))["result"]
        assert json.dumps(sent) == json.dumps(result.to_dict())


def test_an_operation_text_is_made_to_fit_the_wire_and_what_cannot_leaves_its_details_out() -> None:
    from flexium import protocol
    from flexium.client.reports import operation_report

    # Text is made to fit (cut to the limit, NUL and lone surrogates replaced): the details go.
    long = operation_report(replace(_FAILED_MIGRATION, error="e" * (protocol.MAX_LONG_TEXT + 1)))
    assert long is not None and long.error == "e" * protocol.MAX_LONG_TEXT
    odd = operation_report(replace(_FAILED_MIGRATION, notes=("x\x00y", "z\udcff")))
    assert odd is not None and odd.notes == ["x\ufffdy", "z\ufffd"]
    # What cannot be made to fit leaves them out.
    assert operation_report(replace(_FAILED_MIGRATION, seconds=float("inf"))) is None


def test_a_job_started_with_an_argument_that_is_not_utf8_registers_with_it_cleaned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`python train.py donn<0xE9>es.csv` on a UTF-8 system: Python keeps the byte as a lone
    surrogate, which no JSON for the server can carry; the body has U+FFFD there instead."""
    from types import SimpleNamespace

    from flexium import wire
    from flexium.client.reports import ProcessReporter

    monkeypatch.setattr(sys, "orig_argv", ["python", "train.py", "donn\udce9es.csv"])
    session = SimpleNamespace(engine=None, logical_device="cpu", capabilities=None, process_id="cpu-1", config=None)
    body = ProcessReporter(session).register_body(no_gpus())  # type: ignore[arg-type]
    assert body.cmdline == "python train.py 'donn\ufffdes.csv'"
    wire.RegisterRequest.model_validate_json(body.model_dump_json())  # the server reads it


def test_heartbeats_carry_the_steps_counted_and_the_loss_reported() -> None:
    from types import SimpleNamespace

    import torch

    from flexium.api.progress import TrainingProgress
    from flexium.client.reports import ProcessReporter

    progress = TrainingProgress()
    session = SimpleNamespace(engine=None, logical_device="cpu", capabilities=None, process_id="cpu-1", config=None)
    reporter = ProcessReporter(session, progress)  # type: ignore[arg-type]
    body = reporter.heartbeat_body(no_gpus())
    assert "steps" not in body.model_fields_set and "loss" not in body.model_fields_set  # nothing known: nothing said
    assert progress.install()
    try:
        weight = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([weight], lr=0.1)
        for _ in range(3):
            weight.sum().backward()
            optimizer.step()
        progress.record(loss=0.75)
        body = reporter.heartbeat_body(no_gpus())
        assert (body.steps, body.loss) == (3, 0.75)
        registered = reporter.register_body(no_gpus())
        assert (registered.steps, registered.loss) == (3, 0.75)
        progress.record(loss=float("nan"))  # the wire carries finite numbers only: not sent
        assert "loss" not in reporter.heartbeat_body(no_gpus()).model_fields_set
        progress.record(step=1000)  # a loop without torch.optim states its own count
        assert reporter.heartbeat_body(no_gpus()).steps == 1000
        with pytest.raises(ValueError, match="count of steps"):
            progress.record(step=-1)
    finally:
        progress.uninstall()
    optimizer.step()  # uninstalled: no longer counted
    assert progress.counted_steps == 3


def test_flexium_auto_report_records_without_a_server() -> None:
    import flexium.auto
    from flexium.api.progress import PROGRESS

    try:
        flexium.auto.report(loss=1.5, step=7)
        assert (PROGRESS.loss, PROGRESS.steps) == (1.5, 7)
    finally:
        PROGRESS.reset()


def test_counting_steps_never_imports_torch_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from flexium.api.progress import TrainingProgress

    progress = TrainingProgress()
    monkeypatch.delitem(sys.modules, "torch.optim", raising=False)
    assert not progress.install()  # the job has not imported torch yet: nothing hooked
    assert progress.steps is None and "torch.optim" not in sys.modules
    monkeypatch.undo()
    import torch.optim  # noqa: F401  (the job imports it after flexium.init())

    try:
        assert progress.hook_if_ready()  # the next heartbeat starts counting
        assert progress.steps == 0
    finally:
        progress.uninstall()
