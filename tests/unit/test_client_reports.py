"""What the client tells the server about the host's GPUs."""

from __future__ import annotations

from flexium.client.reports import gpu_reports
from flexium.engine.nvml import HostGpu


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


def test_a_failed_engine_is_reported_as_failed() -> None:
    from types import SimpleNamespace

    from flexium.client.reports import ProcessReporter
    from flexium.engine.operations import EngineState

    session = SimpleNamespace(engine=SimpleNamespace(state=EngineState.FAILED))
    assert ProcessReporter(session).state() == "FAILED"  # type: ignore[arg-type]


def test_every_body_carries_a_growing_seq() -> None:
    from types import SimpleNamespace

    from flexium.client.reports import ProcessReporter

    session = SimpleNamespace(engine=None, logical_device="cpu", capabilities=None, process_id="cpu-1")
    reporter = ProcessReporter(session)  # type: ignore[arg-type]
    seqs = [
        reporter.register_body([]).seq,
        reporter.heartbeat_body([]).seq,
        reporter.process_update().seq,
        reporter.heartbeat_body([]).seq,
    ]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_the_fast_path_status_goes_out_with_the_capabilities() -> None:
    from types import SimpleNamespace

    from flexium import protocol
    from flexium.client.reports import ProcessReporter

    engine = SimpleNamespace(state=None)
    on = SimpleNamespace(active=True, reason_off=None)
    off = SimpleNamespace(active=False, reason_off="switched off (fast_path false, from FLEXIUM_FAST_PATH)")

    def caps(**session: object) -> dict[str, object]:
        base = dict(engine=engine, logical_device="cuda:0", capabilities=None, process_id="gpu-1", memory_pool=None)
        return ProcessReporter(SimpleNamespace(**{**base, **session})).capabilities()  # type: ignore[arg-type]

    assert caps(memory_pool=on)[protocol.CAP_FAST_PATH] is True
    assert caps(memory_pool=on)[protocol.CAP_FAST_PATH_PROBLEM] is None
    assert caps(memory_pool=off)[protocol.CAP_FAST_PATH] is False
    assert caps(memory_pool=off)[protocol.CAP_FAST_PATH_PROBLEM] == off.reason_off
    no_pool = caps()
    assert no_pool[protocol.CAP_FAST_PATH] is False and "no CUDA torch" in str(no_pool[protocol.CAP_FAST_PATH_PROBLEM])
    assert caps(engine=None, memory_pool=on)[protocol.CAP_FAST_PATH] is False  # no engine: nothing moves


def test_a_process_without_an_engine_says_it_is_on_no_gpu() -> None:
    """A heartbeat's gpu_uuid None means "on no GPU" (no engine): it goes out as null, while a
    field the body leaves out means "unchanged" and does not go out at all. The index and the
    cuda:N shown with it are the server's to derive: they are never sent."""
    from types import SimpleNamespace

    from flexium.client.http import _body
    from flexium.client.reports import ProcessReporter

    session = SimpleNamespace(engine=None, logical_device="cpu", capabilities=None, process_id="cpu-1")
    sent = _body(ProcessReporter(session).heartbeat_body([]))  # type: ignore[arg-type]
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
    session = SimpleNamespace(engine=engine, logical_device="cuda:0", capabilities=None, process_id="gpu-1")
    reporter = ProcessReporter(session)  # type: ignore[arg-type]
    beat = _body(reporter.heartbeat_body([]))
    assert beat["state"] == "PAUSED" and beat["gpu_uuid"] == "GPU-1" and "physical_device" not in beat
    registered = reporter.register_body([])
    assert registered.gpu_uuid == "GPU-1" and registered.visible_gpus == ["GPU-0", "GPU-1"]
