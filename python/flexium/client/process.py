"""The training process's side of the server connection: two daemon threads.

* The reporter registers the process (in the background, each attempt short, retried with
  backoff while the server is away), then sends a heartbeat every ``heartbeat_interval_s``
  and at once when the engine changes state. A 404 or 401 means the server forgot the process
  (a restart on a new database, a removal): it registers again with its current state, so a
  paused job comes back as PAUSED. While the job is paused and waits in the server's queue, it
  also watches the GPUs the server names and says at once when the room appears (``RoomWatch``).
* The control thread waits on the server's long-poll for the next command, reports it
  running, runs it through the engine (which waits for a safe point itself) and reports the
  outcome with the operation's timings and where the process is now.

Training is never held back: every request runs on these threads with a timeout, and nothing
here waits for the training thread except the engine operation itself.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from flexium import protocol, wire
from flexium.api.progress import PROGRESS
from flexium.client.contracts import TrainingProcess
from flexium.client.http import ApiClient, Backoff, NotFound, Refused, ServerError, Unauthorized, UnreadableCommand
from flexium.client.reports import GpuReading, ProcessReporter, operation_report, visible_gpus
from flexium.client.room_watch import RoomWatch
from flexium.engine.distributed.job_operation import JobOperation
from flexium.engine.operations import EngineState, OperationKind, OperationResult
from flexium.errors import (
    CapabilityError,
    InvalidStateError,
    OperationFailedError,
    OperationInProgressError,
    TargetRefusedError,
)

log = logging.getLogger("flexium.client")

REGISTER_TIMEOUT_S = 2.0
HEARTBEAT_TIMEOUT_S = 5.0
REPORT_TIMEOUT_S = 5.0
UNREGISTER_TIMEOUT_S = 1.0
# A long-poll that ends this early without a command means the server is answering at once
# (it is shutting down): wait before asking again instead of spinning.
EARLY_POLL_END_S = 0.5
POLL_NEWS_BEFORE = 0.9  # an empty long-poll answered before this share of its wait: heartbeat now
# The final outcome of a command is kept to answer a repeated delivery without running it again.
REMEMBERED_COMMANDS = 64

# A command is known by (id, created_at): on SQLite the server may hand a deleted command's
# id to a new one. created_at is None when a command this client cannot read lacks it.
_CommandKey = tuple[int, float | None]

_REFUSALS = (TargetRefusedError, InvalidStateError, CapabilityError, OperationInProgressError)


class ProcessClient:
    def __init__(self, training: TrainingProcess, api: ApiClient, *, reporter: ProcessReporter | None = None) -> None:
        self.training = training
        self.api = api
        self.engine = training.engine
        self.process_id: str = training.process_id
        self.reporter = reporter or ProcessReporter(training)
        # Counted from start to stop: the heartbeats carry the count (ProcessReporter reads it).
        self.progress = PROGRESS
        self.heartbeat_interval_s = protocol.HEARTBEAT_INTERVAL_S
        self.poll_timeout_s = protocol.POLL_TIMEOUT_S
        self.registrations = 0
        self.last_delivery_s: float | None = None  # created -> received, of the last command
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._registered = threading.Event()
        self._connected = True  # what the log last said, so a long outage is logged once
        self._last_bad_answer: str | None = None  # see _poll_failed
        self._last_refusal: str | None = None  # see _register
        # What the server was last told the process can do: a rank's changes as its job starts
        # its process group, and only a registration carries it.
        self._registered_capabilities: wire.ProcessCapabilities | None = None
        self._finished: collections.OrderedDict[_CommandKey, wire.CommandReport] = collections.OrderedDict()
        self.room_watch = RoomWatch()
        # Held while a body that says where the process is gets built and sent: a heartbeat
        # built during an operation (PAUSING) must not reach the server after the outcome
        # (PAUSED) and overwrite it.
        self._send_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> ProcessClient:
        self.progress.install()
        if self.engine is not None:
            self.engine.add_state_listener(self._on_engine_state)
        for name, target in (("flexium-reporter", self._report_loop), ("flexium-control", self._control_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout: float = UNREGISTER_TIMEOUT_S) -> None:
        """Unregisters (one short attempt) and lets the threads end; never waits for a
        long-poll or a server that does not answer. The unregister runs in a thread of its own,
        waited for at most 2 × ``timeout``: its connection's name lookup, which no timeout of the
        request's bounds, may hang as long as DNS does, and the process must exit."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self.progress.uninstall()
        unregistering = threading.Thread(
            target=self._unregister, args=(timeout,), name="flexium-unregister", daemon=True
        )
        unregistering.start()
        unregistering.join(2 * timeout)
        for thread in self._threads:
            thread.join(0.2)
        self.api.close()

    def _unregister(self, timeout: float) -> None:
        # A registration in flight finishes first, so that it cannot land after the unregister.
        locked = self._send_lock.acquire(timeout=timeout)
        try:
            if self._registered.is_set():
                self.api.unregister(self.process_id, timeout=timeout)
        except ServerError as exc:
            log.debug("unregister failed: %s", exc)
        except Exception:  # a daemon thread's failure at exit is only a process left to go stale
            log.debug("unregister failed", exc_info=True)
        finally:
            if locked:
                self._send_lock.release()

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    def wait_registered(self, timeout: float) -> bool:
        return self._registered.wait(timeout)

    def _on_engine_state(self, _state: EngineState) -> None:
        # Called on whichever thread changed the state, the training thread included: only
        # a flag here, the heartbeat goes out from the reporter thread.
        self._wake.set()

    # ---- reporter thread: register, heartbeats ----------------------------------------------

    def _report_loop(self) -> None:
        backoff = Backoff()
        next_beat = 0.0
        while not self._stop.is_set():
            if not self._registered.is_set():
                if self._register():
                    backoff.reset()
                    next_beat = time.monotonic() + self.heartbeat_interval_s
                else:
                    self._stop.wait(backoff.next())
                continue
            watching = self._watching()
            wait = max(0.0, next_beat - time.monotonic())
            woken = self._wake.wait(min(wait, protocol.ROOM_WATCH_INTERVAL_S) if watching else wait)
            self._wake.clear()
            if self._stop.is_set():
                return
            if not self._registered.is_set():
                continue
            room_seen = watching and not woken and self._room_appeared()
            if woken or room_seen or time.monotonic() >= next_beat:
                if not self._heartbeat(room_seen=room_seen) and room_seen:
                    self.room_watch.tell_again()  # the server did not hear it
                next_beat = time.monotonic() + self.heartbeat_interval_s

    def _watching(self) -> bool:
        """Whether the job is paused and waits in the queue: its GPUs are watched."""
        engine = self.engine
        return self.room_watch.watching is not None and engine is not None and engine.state == EngineState.PAUSED

    def _room_appeared(self) -> bool:
        try:
            reading = GpuReading.take()  # through the NVML reader process: the job is checkpointed
        except Exception:  # a reading that fails is only a watch missed; heartbeats go on
            log.debug("reading the GPUs this paused job waits for failed", exc_info=True)
            return False
        appeared = self.room_watch.room_appeared(reading.gpus)
        if appeared:
            log.info("room appeared on a GPU this paused job waits for: telling the server now")
        return appeared

    def _register(self) -> bool:
        try:
            reading = GpuReading.take()
            with self._send_lock:
                body = self.reporter.register_body(reading)
                answer = self.api.register(body, timeout=REGISTER_TIMEOUT_S)
        except Unauthorized as exc:
            # Said once per reason, whether or not an outage was said before: a revoked token (the demo
            # that printed it stopped) does not pass, and training goes on without the server meanwhile.
            self._connected = False
            if exc.message != self._last_refusal:
                log.warning(
                    "the server refused this process's token (%s): training continues without flexium's server; "
                    "set %s or 'token:' in .flexiumrc to a token of the workspace and start the job again",
                    exc.message,
                    protocol.TOKEN_ENV,
                )
                self._last_refusal = exc.message
            return False
        except Refused as exc:
            # The server understood and said no: a problem of this client or its process, never a
            # passing one, so it is said at ERROR (once per reason), not lost among outages.
            if exc.message != self._last_refusal:
                log.error(
                    "the server refused to register this process (%s); training continues without flexium's "
                    "server until it is fixed: report this to flexium's developers",
                    exc.message,
                )
                self._last_refusal = exc.message
            return False
        except ServerError as exc:
            self._lost(exc.message)
            return False
        except Exception:  # a bug building the report must not end the thread
            log.exception("registering with the server failed")
            return False
        self._registered_capabilities = body.capabilities
        self.room_watch.follow(answer.watch)
        self.heartbeat_interval_s = answer.heartbeat_interval_s or self.heartbeat_interval_s
        self.poll_timeout_s = answer.poll_timeout_s or self.poll_timeout_s
        self.registrations += 1
        self._registered.set()
        self._connected = True
        log.info(
            "%s with the server %s/%s as process %s (%s)",
            "registered" if self.registrations == 1 else "registered again",
            self.api.base_url,
            self.api.workspace,
            self.process_id,
            body.state,
        )
        return True

    def _heartbeat(self, *, room_seen: bool = False) -> bool:
        """Whether the server answered. ``room_seen``: the room the job waits for appeared; its
        devices are stored at once."""
        try:
            if self.reporter.capabilities() != self._registered_capabilities:
                log.info("what this process can do changed: registering again to tell the server")
                self._registered.clear()
                return False
            reading = GpuReading.take()  # outside the lock: a frozen process's read takes a child process
            with self._send_lock:
                body = self.reporter.heartbeat_body(reading)
                if room_seen:
                    body.room_seen = True
                answer = self.api.heartbeat(self.process_id, body, timeout=HEARTBEAT_TIMEOUT_S)
        except (NotFound, Unauthorized) as exc:
            log.info("the server does not know this process any more (%s): registering again", exc.message)
            self._registered.clear()
            return False
        except ServerError as exc:
            self._lost(exc.message)
            return False
        except Exception:
            log.exception("heartbeat failed")
            return False
        if not self._connected:
            log.info("the server %s answers again", self.api.base_url)
            self._connected = True
        self.room_watch.follow(answer.watch)
        if answer.heartbeat_interval_s:
            self.heartbeat_interval_s = answer.heartbeat_interval_s
        return True

    def _lost(self, why: str) -> None:
        message = f"{why}; training continues, flexium keeps trying in the background"
        if self._connected:
            log.warning("%s", message)
            self._connected = False
        else:
            log.debug("%s", message)

    # ---- control thread: long-poll, run, report ---------------------------------------------

    def _control_loop(self) -> None:
        backoff = Backoff()
        while not self._stop.is_set():
            if not self._registered.wait(0.5):
                continue
            wait = self.poll_timeout_s
            asked = time.monotonic()
            try:
                command = self.api.next_command(self.process_id, wait=wait, stop=self._stop, backoff=backoff)
            except (NotFound, Unauthorized):
                self._registered.clear()
                self._wake.set()
                continue
            except ServerError as exc:
                if not self._stop.is_set():
                    self._poll_failed(exc)
                    self._stop.wait(backoff.next())
                continue
            except Exception:
                log.exception("long-poll failed")
                self._stop.wait(backoff.next())
                continue
            self._last_bad_answer = None
            if self._stop.is_set():
                # A long-poll answered after stop() belongs to no one now (a new client of this
                # process, after shutdown() and init(), polls for the same id): leave the
                # command to it; the server hands an unacknowledged command out again.
                return
            if command is None:
                answered_in = time.monotonic() - asked
                if answered_in < wait * POLL_NEWS_BEFORE:
                    # An empty answer well before its wait: the server has news for this process
                    # (it was queued: what to watch), which its heartbeat's answer carries.
                    self._wake.set()
                if answered_in < EARLY_POLL_END_S:
                    self._stop.wait(backoff.next())
                else:
                    backoff.reset()
                continue
            backoff.reset()
            try:
                self._execute(command)
            except Exception:
                log.exception("running command %s failed", command.id)

    def _poll_failed(self, exc: ServerError) -> None:
        if exc.code == "bad_response" and exc.message != self._last_bad_answer:
            # A body no command can be read from, not even its id, so nothing can answer it:
            # the server hands it out again on every poll (each after a backoff wait) until
            # it expires the command.
            log.warning("%s", exc.message)
            self._last_bad_answer = exc.message
        else:
            log.debug("long-poll failed: %s", exc)

    def _execute(self, command: wire.CommandInfo | UnreadableCommand) -> None:
        received = time.time()
        key = (command.id, command.created_at)
        done = self._finished.get(key)
        if done is not None:
            # Delivered again (our earlier answer was lost): never run an operation twice,
            # never give one command two different answers.
            self._send_report(command.id, done, final=True)
            return
        if isinstance(command, UnreadableCommand):
            # Answered as failed, not left to the server: it would hand it out on every
            # poll, and hold back every later command of this process, until it expired.
            log.warning("command %d: %s", command.id, command.problem)
            self._finish(key, self._failed(command.problem))
            return
        self.last_delivery_s = max(0.0, received - command.created_at)
        target = self._shown(command.target_uuid)
        log.info(
            "command %d: %s%s (received %.1f ms after it was created)",
            command.id,
            command.kind,
            f" to {target}" if target else "",
            self.last_delivery_s * 1e3,
        )
        self._send_report(command.id, wire.CommandReport(state="running"), final=False)
        self._finish(key, self._run(command))

    def _finish(self, key: _CommandKey, report: wire.CommandReport) -> None:
        self._finished[key] = report
        while len(self._finished) > REMEMBERED_COMMANDS:
            self._finished.popitem(last=False)
        self._send_report(key[0], report, final=True)
        self._wake.set()

    def _shown(self, uuid: str | None) -> str | None:
        """A GPU as this job numbers it (``cuda:N``), else its UUID."""
        if uuid is None or self.engine is None:
            return uuid
        return wire.cuda_ordinal(visible_gpus(self.engine), uuid) or uuid

    def _run(self, command: wire.CommandInfo) -> wire.CommandReport:
        kind = command.kind
        engine = self.engine
        if engine is None:
            problems = "; ".join(self.reporter.capabilities().problems) or "no engine"
            return self._failed(f"this process cannot {kind}: {problems}")
        # The server resolved the person's target to a UUID, which names the physical GPU
        # whatever the process's ordinals have become; the engine takes nothing else.
        target = command.target_uuid
        try:
            result: OperationResult
            if command.job is not None:
                result = engine.run_job_operation(job_operation_of(command, command.job))
            elif kind == "migrate" and command.gpu_moves:
                result = engine.migrate(moves=command.gpu_moves)
            elif kind == "migrate":
                if not target:
                    return self._failed("migrate needs a target GPU")
                result = engine.migrate(target)
            elif kind == "pause":
                result = engine.pause()
            else:
                result = engine.resume(target)
        except OperationFailedError as exc:
            return self._failed(str(exc), result=operation_report(exc.result) if exc.result is not None else None)
        except _REFUSALS as exc:
            return self._failed(str(exc))
        except Exception as exc:
            log.exception("%s failed", kind)
            return self._failed(f"{type(exc).__name__}: {exc}")
        return _with_result(
            wire.CommandReport(state="succeeded", process=self.reporter.process_update()), operation_report(result)
        )

    def _failed(self, error: str, *, result: wire.OperationReport | None = None) -> wire.CommandReport:
        report = wire.CommandReport(
            state="failed",
            error=wire.clean_text(error)[: protocol.MAX_LONG_TEXT],
            process=self.reporter.process_update(),
        )
        return _with_result(report, result)

    def _send_report(self, command_id: int, report: wire.CommandReport, *, final: bool) -> None:
        """A final outcome is retried until the server takes it (or the client stops): it is
        the only record of what the process did. 'running' is tried briefly; the operation
        does not wait for the server. The send lock is held for each attempt only: heartbeats go
        out between them (the server orders bodies by ``seq``), else a server that refuses only
        reports would see the job go stale."""
        try:
            retries = None if final else 2
            self.api.report_command(
                command_id, report, timeout=REPORT_TIMEOUT_S, retries=retries, stop=self._stop, hold=self._send_lock
            )
        except (NotFound, Refused, Unauthorized) as exc:
            log.warning("the server refused the report on command %d (%s): %s", command_id, report.state, exc.message)
        except ServerError as exc:
            log.warning("could not report command %d %s: %s", command_id, report.state, exc.message)


def job_operation_of(command: wire.CommandInfo, job: wire.JobCommandInfo) -> JobOperation:
    """This rank's part of a whole-job operation, as the engine takes it."""
    return JobOperation(
        operation_id=job.operation_id,
        kind=OperationKind(command.kind),
        rank=job.rank,
        world_size=job.world_size,
        target=command.target_uuid,
    )


def _with_result(report: wire.CommandReport, result: wire.OperationReport | None) -> wire.CommandReport:
    """A report without a result leaves the key out, as clients always have."""
    if result is not None:
        report.result = result
    return report
