"""Prometheus metrics (``GET /metrics``), each series named ``flexium_...``.

The server's totals (``Metrics``): counts that must survive a restart (processes by state,
commands by state) are read from the database, rates and latencies counted in this process. A
workspace's GPUs and jobs (``ClusterSeries``) are rendered apart, for that workspace's scrapes
alone. Both are read and rendered at most once every ``metrics_refresh_s`` (``ScrapeCache``):
see ``server/metrics_scrape.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Iterator
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from flexium import protocol
from flexium.server.storage.series import WorkspaceSeries

CONTENT_TYPE = CONTENT_TYPE_LATEST

_OPERATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
_DELIVERY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30)


_GPU_LABELS = ["workspace", "host", "uuid", "index", "name"]
_JOB_LABELS = ["workspace", "process_id", "name", "host", "job", "rank"]


class ClusterSeries(Collector):
    """Per-GPU and per-job gauges of one workspace as read: a GPU or a job that is gone has no
    series at all (labelled Gauges would keep its last value until the server restarts)."""

    def __init__(self, snapshot: WorkspaceSeries) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # dynamic: no fixed series to check at registration

    def collect(self) -> Iterator[Metric]:
        gpu = {
            "memory_used": GaugeMetricFamily(
                "flexium_gpu_memory_used_bytes", "GPU memory in use, by every process on it.", labels=_GPU_LABELS
            ),
            "memory_total": GaugeMetricFamily("flexium_gpu_memory_total_bytes", "GPU memory.", labels=_GPU_LABELS),
            "memory_flexium": GaugeMetricFamily(
                "flexium_gpu_memory_flexium_bytes",
                "GPU memory held by the workspace's flexium jobs.",
                labels=_GPU_LABELS,
            ),
            "utilization": GaugeMetricFamily(
                "flexium_gpu_utilization_percent", "GPU utilization as NVML reports it.", labels=_GPU_LABELS
            ),
            "temperature": GaugeMetricFamily("flexium_gpu_temperature_celsius", "GPU temperature.", labels=_GPU_LABELS),
            "updated_at": GaugeMetricFamily(
                "flexium_gpu_report_time_seconds", "When its host last reported it (epoch).", labels=_GPU_LABELS
            ),
        }
        job_state = GaugeMetricFamily(
            "flexium_job_state",
            "1 for the state a process is in (STALE: heartbeats stopped); job and rank are empty for a single process.",
            labels=[*_JOB_LABELS, "state"],
        )
        job = {
            "memory_bytes": GaugeMetricFamily(
                "flexium_job_memory_bytes", "GPU memory a process holds now.", labels=_JOB_LABELS
            ),
            "steps": GaugeMetricFamily(
                "flexium_job_steps", "Optimizer steps the process has taken, as last reported.", labels=_JOB_LABELS
            ),
            "steps_per_s": GaugeMetricFamily(
                "flexium_job_steps_per_second", "Training speed between its last two reports.", labels=_JOB_LABELS
            ),
            "loss": GaugeMetricFamily(
                "flexium_job_loss", "The last loss the job reported (flexium.auto.report).", labels=_JOB_LABELS
            ),
        }
        ws = self.snapshot
        for host in ws.hosts:
            for d in host.devices:
                labels = [ws.workspace, host.host, d.uuid, "" if d.index is None else str(d.index), d.name]
                for field, family in gpu.items():
                    value: float | None = getattr(d, field)
                    if value is not None:
                        family.add_metric(labels, float(value))
        for p in ws.processes:
            labels = [
                ws.workspace,
                p.process_id,
                p.name,
                p.host,
                p.job.key if p.job is not None else "",
                str(p.job.rank) if p.job is not None else "",
            ]
            job_state.add_metric([*labels, p.state], 1.0)
            for field, family in job.items():
                value = getattr(p, field)
                if value is not None:
                    family.add_metric(labels, float(value))
        yield from gpu.values()
        yield job_state
        yield from job.values()


class Metrics:
    def __init__(self) -> None:
        # '_created' series only add noise here; prometheus_client leaves this function untyped.
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.processes = Gauge(
            "flexium_processes", "Processes by shown state (STALE: heartbeats stopped).", ["state"], registry=r
        )
        self.commands = Gauge("flexium_commands", "Commands in the database by state.", ["state"], registry=r)
        self.commands_finished = Counter(
            "flexium_commands_finished",
            "Commands that ended, by kind and outcome (succeeded, failed, expired), since this server started.",
            ["kind", "outcome"],
            registry=r,
        )
        self.commands_created = Counter("flexium_commands_created", "Commands accepted, by kind.", ["kind"], registry=r)
        self.commands_refused = Counter(
            "flexium_commands_refused", "Command requests refused, by error code.", ["error"], registry=r
        )
        self.migration_duration = Histogram(
            "flexium_migration_duration_seconds",
            "Duration of migrate / pause / resume operations as the processes report them.",
            ["kind", "outcome"],
            buckets=_OPERATION_BUCKETS,
            registry=r,
        )
        self.delivery_latency = Histogram(
            "flexium_command_delivery_seconds",
            "From a command's creation to its first delivery.",
            buckets=_DELIVERY_BUCKETS,
            registry=r,
        )
        self.queue_decision = Histogram(
            "flexium_queue_decision_seconds",
            "One pass of the resume-when-free queue over a host (or all hosts, at the sweep): its transaction.",
            buckets=_DELIVERY_BUCKETS,
            registry=r,
        )
        self.queue_resumes = Counter(
            "flexium_queue_resumes", "Resumes the queue sent for jobs waiting for room.", registry=r
        )
        self.schema_migration = Histogram(
            "flexium_schema_migration_duration_seconds",
            "Database schema upgrade at start.",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=r,
        )
        self.heartbeats = Counter("flexium_heartbeats", "Heartbeats received.", registry=r)
        self.long_polls = Gauge("flexium_long_polls_waiting", "Long-polls waiting for a command.", registry=r)
        self.sse_subscribers = Gauge("flexium_sse_subscribers", "Open live event streams.", registry=r)
        self.db_waiting = Gauge("flexium_db_calls_waiting", "Database calls queued for a worker thread.", registry=r)
        self.loop_stalls = Histogram(
            "flexium_server_loop_stall_seconds",
            "Stretches in which the server's event loop did not run for a second or more (every request waited).",
            buckets=(1, 2, 5, 10, 30, 60, 300),
            registry=r,
        )
        self.up_since = Gauge("flexium_server_start_time_seconds", "When this server started (epoch).", registry=r)
        self.pages = ScrapeCache()
        for state in protocol.DISPLAY_STATES:
            self.processes.labels(state=state)
        for state in protocol.COMMAND_STATES:
            self.commands.labels(state=state)
        for kind in protocol.COMMAND_KINDS:  # every series exists from the start, at zero
            self.commands_created.labels(kind=kind)
            for outcome in protocol.FINAL_COMMAND_STATES:
                self.commands_finished.labels(kind=kind, outcome=outcome)
            for outcome in ("succeeded", "failed"):
                self.migration_duration.labels(kind=kind, outcome=outcome)

    def render(
        self,
        *,
        processes: dict[str, int],
        commands: dict[str, int],
        long_polls: int,
        sse_subscribers: int,
        db_waiting: int = 0,
    ) -> bytes:
        """The server's totals: these counts, and what this process counted."""
        self.db_waiting.set(db_waiting)
        for state, n in processes.items():
            self.processes.labels(state=state).set(n)
        for state, n in commands.items():
            self.commands.labels(state=state).set(n)
        self.long_polls.set(long_polls)
        self.sse_subscribers.set(sse_subscribers)
        return generate_latest(self.registry)


def render_workspace(series: WorkspaceSeries) -> bytes:
    """One workspace's GPUs and jobs, in the text format (thousands of lines at the quotas'
    limits: rendered on a worker thread)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterSeries(series))
    return generate_latest(registry)


@dataclass(frozen=True)
class _Page:
    made_at: float
    text: bytes


class ScrapeCache:
    """Pages of metrics by key (the totals, a workspace's series), each made at most once per
    ``fresh_for`` seconds and shared by every scrape meanwhile, those that arrive while it is
    being made included: a flood of scrapes reads the database no more often than one scraper."""

    def __init__(self) -> None:
        self._pages: dict[Hashable, _Page] = {}
        self._making: dict[Hashable, asyncio.Future[bytes]] = {}

    async def page(self, key: Hashable, make: Callable[[], Awaitable[bytes]], *, now: float, fresh_for: float) -> bytes:
        page = self._pages.get(key)
        if page is not None and now - page.made_at < fresh_for:
            return page.text
        making = self._making.get(key)
        if making is None:
            making = asyncio.ensure_future(make())
            self._making[key] = making
            making.add_done_callback(lambda done: self._made(key, done, now, fresh_for))
        return await asyncio.shield(making)

    def _made(self, key: Hashable, done: asyncio.Future[bytes], made_at: float, fresh_for: float) -> None:
        del self._making[key]
        if done.cancelled() or done.exception() is not None:
            return
        # Pages past their time go as new ones come, so a workspace no longer scraped (or gone)
        # holds no memory.
        self._pages = {k: p for k, p in self._pages.items() if made_at - p.made_at < fresh_for}
        self._pages[key] = _Page(made_at, done.result())
