"""/metrics per GPU and per job, parsed as Prometheus reads it."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from support.server import GIB, Api, rank_body


def _samples(api: Api) -> dict[str, list[Any]]:
    by_name: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(api.client.get("/metrics", headers=api.headers()).text):
        for sample in family.samples:
            by_name.setdefault(sample.name, []).append(sample)
    return by_name


def _one(samples: list[Any], **labels: str) -> Any:
    found = [s for s in samples if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (labels, samples)
    return found[0]


def test_metrics_have_a_series_per_gpu_and_per_job(api: Api) -> None:
    api.register("gpu-1", memory=10 * GIB, cmdline="python train.py", steps=7, loss=0.5)
    for rank in (0, 1):
        api.register(f"rank-{rank}", **{k: v for k, v in rank_body(rank).items() if k != "process_id"})
    samples = _samples(api)

    gpu_labels = {"workspace": "default", "host": "node1", "uuid": "GPU-0000", "index": "0", "name": "NVIDIA H200"}
    assert _one(samples["flexium_gpu_memory_total_bytes"], **gpu_labels).value == 140 * GIB
    assert _one(samples["flexium_gpu_memory_used_bytes"], **gpu_labels).value > 0
    assert _one(samples["flexium_gpu_utilization_percent"], **gpu_labels).value == 10
    assert _one(samples["flexium_gpu_temperature_celsius"], **gpu_labels).value == 40
    assert _one(samples["flexium_gpu_memory_flexium_bytes"], **gpu_labels).value >= 10 * GIB
    assert len(samples["flexium_gpu_memory_total_bytes"]) == 4  # one host's 4 GPUs, however many jobs report them
    assert _one(samples["flexium_gpu_report_time_seconds"], **gpu_labels).value <= time.time()

    job = {"workspace": "default", "process_id": "gpu-1", "name": "train.py", "host": "node1", "job": "", "rank": ""}
    assert _one(samples["flexium_job_state"], **job, state="RUNNING").value == 1
    assert _one(samples["flexium_job_memory_bytes"], **job).value == 10 * GIB
    assert _one(samples["flexium_job_steps"], **job).value == 7
    assert _one(samples["flexium_job_loss"], **job).value == 0.5
    rank1 = _one(samples["flexium_job_state"], process_id="rank-1")
    assert (rank1.labels["job"], rank1.labels["rank"], rank1.labels["state"]) == ("run-7f3a", "1", "RUNNING")
    assert not [s for s in samples.get("flexium_job_steps", []) if s.labels["process_id"] == "rank-1"]  # none reported

    # a job that exits has no series any more
    assert api.delete("/processes/gpu-1").status_code == 204
    assert not [s for s in _samples(api)["flexium_job_state"] if s.labels["process_id"] == "gpu-1"]


def test_the_grafana_dashboard_uses_series_the_server_exports(api: Api) -> None:
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json").read_text())
    api.register("gpu-1", steps=1, loss=1.0)
    families = list(text_string_to_metric_families(api.client.get("/metrics", headers=api.headers()).text))
    # a family is exported (HELP, TYPE) even before it has a sample (no steps/s before two reports)
    exported = {f.name for f in families} | {s.name for f in families for s in f.samples}
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bflexium_\w+", target["expr"])
    }
    used |= {name for v in dashboard["templating"]["list"] for name in re.findall(r"\bflexium_\w+", v.get("query", ""))}
    assert used and used <= exported, used - exported
    assert {"flexium_gpu_memory_used_bytes", "flexium_gpu_utilization_percent", "flexium_job_steps_per_second"} <= used
