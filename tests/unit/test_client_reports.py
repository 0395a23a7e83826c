"""What the client tells the server about the host's GPUs."""

from __future__ import annotations

from flexium.client.reports import gpu_reports
from flexium.engine.nvml import HostGpu


def _gpu(health: str) -> HostGpu:
    return HostGpu(index=0, uuid="GPU-0", name="NVIDIA H200", memory_total=100, memory_used=10,
                   memory_free=90, utilization_percent=7, temperature_c=40, health=health, processes=())


def test_gpu_health_is_reported_as_nvml_says() -> None:
    # "unknown" (NVML cannot read ECC counters) goes out as it is: the server accepts it as a
    # target and shows it as unknown, not as healthy.
    assert [r["health"] for r in gpu_reports([_gpu("unknown"), _gpu("ok"), _gpu("ecc_errors")])] == \
        ["unknown", "ok", "ecc_errors"]


def test_a_failed_engine_is_reported_as_failed() -> None:
    from types import SimpleNamespace

    from flexium.client.reports import ProcessReporter
    from flexium.engine.operations import EngineState

    session = SimpleNamespace(engine=SimpleNamespace(state=EngineState.FAILED))
    assert ProcessReporter(session).state() == "FAILED"


def test_every_body_carries_a_growing_seq() -> None:
    from types import SimpleNamespace

    from flexium.client.reports import ProcessReporter

    session = SimpleNamespace(engine=None, logical_device="cpu", capabilities=None, process_id="cpu-1")
    reporter = ProcessReporter(session)
    seqs = [reporter.register_body([])["seq"], reporter.heartbeat_body([])["seq"],
            reporter.process_update()["seq"], reporter.heartbeat_body([])["seq"]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
