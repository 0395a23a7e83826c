"""The one way anything in flexium talks to the server: ``ApiClient.request``.

It owns the base URL, the workspace prefix, the token header, timeouts, retries with capped
exponential backoff and jitter, and the mapping of the server's error bodies
(``{"error", "message"}``, see ``flexium.protocol.ERROR_STATUS``) to exceptions. The training
process's control threads and the command line both use it, through the typed methods below:
they send ``flexium.wire`` models and return them.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, TypeVar, get_args

import requests
import urllib3
from pydantic import BaseModel, TypeAdapter, ValidationError

from flexium import protocol, wire
from flexium.errors import ConfigError, FlexiumError

_Model = TypeVar("_Model", bound=BaseModel)

DEFAULT_TIMEOUT_S = 10.0
DEADLINE_GRACE_S = 2.0  # past a request's deadline, how long its last attempt may still wait for an answer
CONNECT_TIMEOUT_S = 2.0
MIN_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0


class ServerError(FlexiumError):
    """The server answered with an error, or could not be reached. ``code`` is the server's
    error code (``protocol.ERROR_STATUS``), ``status`` the HTTP status (None: no answer)."""

    def __init__(self, message: str, *, code: str, status: int | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.detail = detail


class Unreachable(ServerError):
    """No answer: connection refused, timed out, or cut."""


class LateAnswer(Unreachable):
    """The request was sent and no answer came within the timeout: the server is alive but behind.
    A long-poll asks again at once (the server hands out a command whose answer was lost again)."""


class NotDelivered(Unreachable):
    """No connection could be made (refused, timed out connecting, the name did not resolve): the
    request never reached the server, so sending it again cannot make it happen twice."""


class Unavailable(ServerError):
    """The server answered 5xx (its database is down, it is restarting, a bug)."""


class Unauthorized(ServerError):
    """401/403: no token, a wrong or revoked token, or a token of another workspace."""


class NotFound(ServerError):
    """404: unknown process or command (the server may have forgotten it: register again)."""


class Refused(ServerError):
    """Any other 4xx: the request was understood and refused (invalid state, busy, stale,
    target refused, capability, invalid request, too large)."""


_BY_STATUS: dict[int, type[ServerError]] = {401: Unauthorized, 403: Unauthorized, 404: NotFound}


def error_from_response(response: requests.Response) -> ServerError:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        code = str(body.get("error") or "error")
        message = body["message"]
        detail = body.get("detail")
    else:
        code, detail = ("internal" if response.status_code >= 500 else "bad_request"), None
        text = response.text.strip().splitlines()[0][:200] if response.text.strip() else response.reason
        message = (
            f"HTTP {response.status_code} from {response.url}: {text} (an answer no flexium server gives: is that "
            "address a flexium server, and is the one behind any proxy up?)"
        )
    if response.status_code >= 500:
        cls: type[ServerError] = Unavailable
    else:
        cls = _BY_STATUS.get(response.status_code, Refused)
    return cls(message, code=code, status=response.status_code, detail=detail)


class Backoff:
    """Waits that double from ``base`` up to ``cap``; each is drawn from the upper half of its
    range so that many clients cut off together (a server restart) come back spread out."""

    def __init__(self, base: float = MIN_BACKOFF_S, cap: float = MAX_BACKOFF_S) -> None:
        self.base = base
        self.cap = cap
        self.attempt = 0

    def next(self) -> float:
        delay = min(self.cap, self.base * (2.0**self.attempt))
        self.attempt = min(self.attempt + 1, 30)
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.attempt = 0


def _trusted_cas(address: protocol.ServerAddress, ca_bundle: str | None) -> bool | str:
    """What to verify an https:// server's certificate against. A bundle that cannot be read is
    refused here, by name: requests would raise it from deep inside the first request."""
    path = ca_bundle or os.environ.get(protocol.CA_BUNDLE_ENV)
    if not path:
        return True
    if address.scheme == "https" and not os.access(path, os.R_OK):
        named = "the CA bundle" if ca_bundle else f"${protocol.CA_BUNDLE_ENV}"
        why = "does not exist" if not os.path.exists(path) else "cannot be read by this user"
        raise ConfigError(
            f"{named} names {path}, which {why}: name the PEM file of the CA that signed the server's "
            f"certificate, or unset {protocol.CA_BUNDLE_ENV} to trust the system's CAs"
        )
    return path


class ApiClient:
    """Requests to one workspace of one server. Safe to share between threads: each thread
    gets its own connection pool, so a thread waiting in a long-poll never holds up another."""

    def __init__(
        self,
        address: protocol.ServerAddress,
        token: str | None,
        *,
        user_agent: str = "flexium",
        ca_bundle: str | None = None,
    ) -> None:
        """``ca_bundle``: a PEM file of the CAs to trust for an https:// server (default:
        $FLEXIUM_CA_BUNDLE; without either, the system's CAs, or $REQUESTS_CA_BUNDLE)."""
        self.address = address
        self.verify: bool | str = _trusted_cas(address, ca_bundle)
        self.token = token
        self.user_agent = user_agent
        self._local = threading.local()
        self._pools: list[requests.Session] = []  # one per thread: see ``_pool``
        self._pools_lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return self.address.base_url

    @property
    def workspace(self) -> str:
        return self.address.workspace

    def url(self, path: str, *, workspace: bool = True) -> str:
        prefix = protocol.workspace_path(self.workspace) if workspace else ""
        return f"{self.base_url}{prefix}{path}"

    def _pool(self) -> requests.Session:
        """This thread's connections (a ``requests.Session``: a pool and default headers)."""
        pool: requests.Session | None = getattr(self._local, "pool", None)
        if pool is None:
            pool = requests.Session()
            pool.headers["User-Agent"] = self.user_agent
            if self.token:
                pool.headers[protocol.TOKEN_HEADER] = f"Bearer {self.token}"
            self._local.pool = pool
            with self._pools_lock:
                self._pools.append(pool)
        return pool

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int | None = 0,
        deadline: float | None = None,
        stop: threading.Event | None = None,
        backoff: Backoff | None = None,
        workspace: bool = True,
        hold: threading.Lock | None = None,
    ) -> Any:
        """Sends one request; returns the decoded JSON body, or None for 204.

        ``path`` is relative to the workspace (``protocol.PATH_*``) unless ``workspace=False``.
        ``timeout`` bounds each attempt's wait for an answer (connecting has its own short
        limit). When the server cannot be reached or answers 5xx, the request is tried again
        up to ``retries`` more times (None: until ``stop`` is set or ``deadline``, a
        ``time.monotonic()`` value, passes), after a backoff wait. 4xx answers are never
        retried: they raise Unauthorized, NotFound or Refused with the server's message. ``hold``:
        a lock held for each attempt, never through a backoff wait (others may send between). With
        a ``deadline``, an attempt waits for its answer no longer than what is left of it (and a
        grace of DEADLINE_GRACE_S, for a long-poll answered at its end).
        """
        backoff = backoff or Backoff()
        attempt = 0
        late_again = False
        while True:
            waits = timeout
            if deadline is not None:
                waits = max(1.0, min(timeout, deadline - time.monotonic() + DEADLINE_GRACE_S))
            try:
                with hold if hold is not None else contextlib.nullcontext():
                    return self._once(method, path, json=json, params=params, timeout=waits, workspace=workspace)
            except (Unreachable, Unavailable) as exc:
                attempt += 1
                if retries is not None and attempt > retries:
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                if isinstance(exc, LateAnswer) and not late_again and not (stop is not None and stop.is_set()):
                    late_again = True  # the first of late answers in a row is asked again at once
                    continue
                late_again = isinstance(exc, LateAnswer)
                delay = backoff.next()
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise
                if stop is not None:
                    if stop.wait(delay):
                        raise
                else:
                    if retries is None and deadline is None:
                        raise ValueError("retries=None needs a stop event or a deadline") from exc
                    time.sleep(delay)

    def _once(
        self, method: str, path: str, *, json: Any, params: dict[str, Any] | None, timeout: float, workspace: bool
    ) -> Any:
        url = self.url(path, workspace=workspace)
        try:
            response = self._pool().request(
                method,
                url,
                json=json,
                params=params,
                timeout=(min(CONNECT_TIMEOUT_S, timeout), timeout),
                verify=self.verify,
            )
        except requests.exceptions.SSLError as exc:
            raise Unreachable(
                f"cannot reach the flexium server at {self.base_url}: TLS failed ({_short(exc)}); a server with a "
                f"certificate of its own CA needs that CA's PEM file in ${protocol.CA_BUNDLE_ENV}",
                code="unreachable",
            ) from None
        except requests.ReadTimeout:
            raise LateAnswer(
                f"cannot reach the flexium server at {self.base_url}: no answer within the timeout",
                code="unreachable",
            ) from None
        except requests.RequestException as exc:
            unreached = NotDelivered if _never_connected(exc) else Unreachable
            raise unreached(
                f"cannot reach the flexium server at {self.base_url}: {_short(exc)}", code="unreachable"
            ) from None
        if response.status_code == 204:
            return None
        if response.status_code >= 400:
            raise error_from_response(response)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise Unavailable(
                f"the server at {self.base_url} answered {method} {path} with something other "
                "than JSON; is that address a flexium server?",
                code="bad_response",
                status=response.status_code,
            ) from None

    # ---- typed requests ---------------------------------------------------------------------

    def _read(self, model: type[_Model], answer: object, what: str) -> _Model:
        try:
            return model.model_validate(answer)
        except ValidationError as exc:
            raise _bad_answer(self.base_url, what, exc) from None

    def _read_list(self, model: type[_Model], answer: object, what: str) -> list[_Model]:
        try:
            return TypeAdapter(list[model]).validate_python(answer)  # type: ignore[valid-type]
        except ValidationError as exc:
            raise _bad_answer(self.base_url, what, exc) from None

    def register(self, body: wire.RegisterRequest, *, timeout: float) -> wire.RegisterResponse:
        answer = self.request("POST", protocol.PATH_PROCESSES, json=_body(body), timeout=timeout)
        return self._read(wire.RegisterResponse, answer, "register")

    def heartbeat(self, process_id: str, body: wire.HeartbeatRequest, *, timeout: float) -> wire.HeartbeatResponse:
        answer = self.request(
            "POST", protocol.PATH_HEARTBEAT.format(process_id=process_id), json=_body(body), timeout=timeout
        )
        return self._read(wire.HeartbeatResponse, answer, "heartbeat")

    def unregister(self, process_id: str, *, timeout: float) -> None:
        self.request("DELETE", protocol.PATH_PROCESS.format(process_id=process_id), timeout=timeout)

    def next_command(
        self, process_id: str, *, wait: float, stop: threading.Event, backoff: Backoff
    ) -> wire.CommandInfo | UnreadableCommand | None:
        """The long-poll; None when nothing came within ``wait`` seconds. Retried until
        ``stop`` is set while the server cannot be reached. A command this client cannot read
        but can name comes back as an ``UnreadableCommand``, for the caller to answer."""
        answer = self.request(
            "GET",
            protocol.PATH_NEXT_COMMAND.format(process_id=process_id),
            params={"wait": wait},
            timeout=wait + 10.0,
            retries=None,
            stop=stop,
            backoff=backoff,
        )
        return None if answer is None else self._read_command(answer)

    def _read_command(self, answer: object) -> wire.CommandInfo | UnreadableCommand:
        """The long-poll's answer as a command. The wire model stays exact (its ``kind`` is
        the server's schema); a command that fails it is still answered, by its id, so that
        it neither blocks the process's later commands nor comes back on every poll until it
        expires. Without a readable id nothing can answer it: that is a bad answer."""
        try:
            return wire.CommandInfo.model_validate(answer)
        except ValidationError as exc:
            fields: dict[str, Any] = answer if isinstance(answer, dict) else {}
            command_id = _integer(fields.get("id"))
            if command_id is None:
                raise _bad_answer(self.base_url, "the next command", exc) from None
            return UnreadableCommand(
                id=command_id, created_at=_epoch(fields.get("created_at")), problem=_unreadable(fields, exc)
            )

    def report_command(
        self,
        command_id: int,
        body: wire.CommandReport,
        *,
        timeout: float,
        retries: int | None,
        stop: threading.Event | None = None,
        hold: threading.Lock | None = None,
    ) -> None:
        """The server's answer (the command as it stored it) is left unread: a 2xx means it
        took the report, and a command this client could not read (``UnreadableCommand``)
        would make a taken report look refused."""
        self.request(
            "POST",
            protocol.PATH_COMMAND_REPORT.format(command_id=command_id),
            json=_body(body),
            timeout=timeout,
            retries=retries,
            stop=stop,
            hold=hold,
        )

    def health(self, *, timeout: float = DEFAULT_TIMEOUT_S, retries: int = 0) -> wire.HealthInfo:
        """The server's ``/healthz`` (no workspace, no token needed); a degraded server
        (its database down) answers 503, which raises ``Unavailable``."""
        answer = self.request("GET", protocol.PATH_HEALTH, workspace=False, timeout=timeout, retries=retries)
        return self._read(wire.HealthInfo, answer, "the health check")

    def list_processes(
        self,
        *,
        state: str | None = None,
        host: str | None = None,
        retries: int = 2,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> list[wire.ProcessInfo]:
        params = {name: value for name, value in (("state", state), ("host", host)) if value}
        answer = self.request(
            "GET",
            protocol.PATH_PROCESSES,
            params=params or None,
            timeout=timeout,
            retries=retries,
        )
        return self._read_list(wire.ProcessInfo, answer, "the process list")

    def get_process(self, process_id: str, *, retries: int = 1) -> wire.ProcessInfo:
        answer = self.request("GET", protocol.PATH_PROCESS.format(process_id=process_id), retries=retries)
        return self._read(wire.ProcessInfo, answer, "a process")

    def targets(self, process_id: str, *, kind: wire.TargetKind = "migrate", retries: int = 2) -> list[wire.TargetInfo]:
        answer = self.request(
            "GET", protocol.PATH_TARGETS.format(process_id=process_id), params={"kind": kind}, retries=retries
        )
        return self._read_list(wire.TargetInfo, answer, "the targets")

    def devices(self, *, host: str | None = None, retries: int = 2) -> wire.DevicesResponse:
        answer = self.request("GET", protocol.PATH_DEVICES, params={"host": host} if host else None, retries=retries)
        return self._read(wire.DevicesResponse, answer, "the devices")

    def create_command(self, body: wire.CommandRequest) -> wire.CommandInfo:
        """The addressed process's command; for a rank of a job of several (``body.ranks`` maps
        several ranks), every rank gets one and this is the addressed rank's: its
        ``job.operation_id`` is for ``get_operation`` / ``wait_operation``."""
        # Not retried: after a lost answer the command may be stored, and the server would
        # refuse a second one as busy, hiding the first.
        answer = self.request("POST", protocol.PATH_COMMANDS, json=_body(body))
        return self._read(wire.CommandInfo, answer, "the new command")

    def get_command(self, command_id: int, *, retries: int = 2) -> wire.CommandInfo:
        answer = self.request("GET", protocol.PATH_COMMAND.format(command_id=command_id), retries=retries)
        return self._read(wire.CommandInfo, answer, "a command")

    def wait_command(self, command_id: int, *, wait: float, deadline: float | None = None) -> wire.CommandInfo:
        """The command once it ends, or after ``wait`` seconds (the server's long-poll);
        retried while the server cannot be reached until ``deadline`` (``time.monotonic()``)."""
        answer = self._long_poll(protocol.PATH_COMMAND.format(command_id=command_id), wait, deadline)
        return self._read(wire.CommandInfo, answer, "a command")

    def get_operation(self, operation_id: int, *, retries: int = 2) -> wire.JobOperationInfo:
        """A job operation (``CommandInfo.job.operation_id``): every rank's command, and their
        state taken together."""
        answer = self.request("GET", protocol.PATH_OPERATION.format(operation_id=operation_id), retries=retries)
        return self._read(wire.JobOperationInfo, answer, "a job operation")

    def wait_operation(self, operation_id: int, *, wait: float, deadline: float | None = None) -> wire.JobOperationInfo:
        """The job operation once every rank's command ended, or after ``wait`` seconds (as
        ``wait_command``)."""
        answer = self._long_poll(protocol.PATH_OPERATION.format(operation_id=operation_id), wait, deadline)
        return self._read(wire.JobOperationInfo, answer, "a job operation")

    def _long_poll(self, path: str, wait: float, deadline: float | None) -> Any:
        """GET `path` answered when what it names ends or after `wait` seconds (the server's
        long-poll), retried while the server cannot be reached until `deadline`."""
        return self.request(
            "GET",
            path,
            params={"wait": wait},
            timeout=wait + 10.0,
            retries=None,
            deadline=deadline if deadline is not None else time.monotonic() + wait + 10.0,
        )

    def list_jobs(self, *, retries: int = 2) -> list[wire.JobSummary]:
        """Jobs of several ranks, each with its ranks (``ProcessInfo``) by rank."""
        answer = self.request("GET", protocol.PATH_JOBS, retries=retries)
        return self._read_list(wire.JobSummary, answer, "the job list")

    def create_wait(self, body: wire.WaitRequest) -> wire.WaitCreated:
        """Queue a paused job to be resumed when free (or make room for it); not retried, as
        ``create_command``: a second request would replace the wait the first stored."""
        answer = self.request("POST", protocol.PATH_WAITS, json=_body(body))
        return self._read(wire.WaitCreated, answer, "the new wait")

    def list_waits(
        self, *, process_id: str | None = None, ended: bool = False, retries: int = 2
    ) -> list[wire.WaitInfo]:
        """The queue's live waits in its order (``ended``: every wait, newest first)."""
        params: dict[str, Any] = {"all": "true"} if ended else {}
        if process_id is not None:
            params["process_id"] = process_id
        answer = self.request("GET", protocol.PATH_WAITS, params=params or None, retries=retries)
        return self._read_list(wire.WaitInfo, answer, "the queue")

    def get_wait(self, wait_id: int, *, retries: int = 2) -> wire.WaitInfo:
        answer = self.request("GET", protocol.PATH_WAIT.format(wait_id=wait_id), retries=retries)
        return self._read(wire.WaitInfo, answer, "a wait")

    def cancel_wait(self, wait_id: int) -> wire.WaitInfo:
        answer = self.request("DELETE", protocol.PATH_WAIT.format(wait_id=wait_id))
        return self._read(wire.WaitInfo, answer, "the cancelled wait")

    def list_placements(self, *, ended: bool = False, retries: int = 2) -> list[wire.PlacementInfo]:
        """flexium run's live placements by host in queue order (``ended``: every one, newest first)."""
        answer = self.request(
            "GET", protocol.PATH_PLACEMENTS, params={"all": "true"} if ended else None, retries=retries
        )
        return self._read_list(wire.PlacementInfo, answer, "the placements")

    def create_placement(self, body: wire.PlacementRequest) -> wire.PlacementCreated:
        """flexium run's job placed, or queued for room; not retried, as ``create_wait``."""
        answer = self.request("POST", protocol.PATH_PLACEMENTS, json=_body(body))
        return self._read(wire.PlacementCreated, answer, "the new placement")

    def report_placement(
        self,
        placement_id: int,
        body: wire.PlacementReport,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = 2,
    ) -> wire.PlacementInfo:
        answer = self.request(
            "POST",
            protocol.PATH_PLACEMENT_REPORT.format(placement_id=placement_id),
            json=_body(body),
            timeout=timeout,
            retries=retries,
        )
        return self._read(wire.PlacementInfo, answer, "the placement")

    def close_placement(
        self, placement_id: int, *, timeout: float = DEFAULT_TIMEOUT_S, retries: int = 2
    ) -> wire.PlacementInfo:
        answer = self.request(
            "DELETE", protocol.PATH_PLACEMENT.format(placement_id=placement_id), timeout=timeout, retries=retries
        )
        return self._read(wire.PlacementInfo, answer, "the placement")

    def issue_token(self, body: wire.TokenRequest) -> wire.TokenCreated:
        answer = self.request("POST", protocol.PATH_TOKENS, json=_body(body))
        return self._read(wire.TokenCreated, answer, "the new token")

    def revoke_token(self, token_id: int, *, timeout: float = DEFAULT_TIMEOUT_S, retries: int = 2) -> wire.TokenRevoked:
        answer = self.request("DELETE", protocol.PATH_TOKEN.format(token_id=token_id), timeout=timeout, retries=retries)
        return self._read(wire.TokenRevoked, answer, "the revoked token")

    def set_priority(self, process_id: str, priority: int) -> wire.ProcessInfo:
        answer = self.request(
            "PUT", protocol.PATH_PRIORITY.format(process_id=process_id), json={"priority": priority}, retries=1
        )
        return self._read(wire.ProcessInfo, answer, "the process")

    def create_drain(self, body: wire.DrainRequest) -> wire.DrainInfo:
        """Drain a GPU of a host, or all of them; not retried: a second request is refused (drained already)."""
        answer = self.request("POST", protocol.PATH_DRAINS, json=_body(body))
        return self._read(wire.DrainInfo, answer, "the new drain")

    def list_drains(self, *, host: str | None = None, ended: bool = False, retries: int = 2) -> list[wire.DrainInfo]:
        params: dict[str, Any] = {"all": "true"} if ended else {}
        if host is not None:
            params["host"] = host
        answer = self.request("GET", protocol.PATH_DRAINS, params=params or None, retries=retries)
        return self._read_list(wire.DrainInfo, answer, "the drains")

    def get_drain(self, drain_id: int, *, retries: int = 2) -> wire.DrainInfo:
        answer = self.request("GET", protocol.PATH_DRAIN.format(drain_id=drain_id), retries=retries)
        return self._read(wire.DrainInfo, answer, "a drain")

    def undrain(self, drain_id: int) -> wire.DrainInfo:
        answer = self.request("DELETE", protocol.PATH_DRAIN.format(drain_id=drain_id))
        return self._read(wire.DrainInfo, answer, "the ended drain")

    def close(self) -> None:
        with self._pools_lock:
            pools, self._pools = self._pools, []
        for pool in pools:
            pool.close()


def _body(model: BaseModel) -> Any:
    """What a request model sends: the fields set, None included (see ``flexium.wire``)."""
    return model.model_dump(mode="json", exclude_unset=True)


def _bad_answer(base_url: str, what: str, exc: ValidationError) -> ServerError:
    return Unavailable(
        f"the server at {base_url} answered {what} with a body this client cannot read "
        f"({_first_error(exc)}); is it a flexium server of a compatible version?",
        code="bad_response",
    )


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
    where = ".".join(str(part) for part in first["loc"]) or "body"
    return f"{where}: {first['msg']}"


@dataclass(frozen=True)
class UnreadableCommand:
    """A command from the long-poll that does not validate as ``wire.CommandInfo`` (a newer
    server's kind, a field of another shape), with its ``created_at`` where it could be read
    on its own. ``problem`` says what could not be read and what to do: the error of the
    failed report that answers it."""

    id: int
    created_at: float | None
    problem: str


def _unreadable(fields: dict[str, Any], exc: ValidationError) -> str:
    from flexium import __version__

    kind = fields.get("kind")
    if isinstance(kind, str) and kind not in get_args(wire.CommandKind):
        return (
            f"this flexium (version {__version__}) cannot run command kind {kind[:40]!r} sent by the server; "
            "upgrade flexium in the job to a version that knows it"
        )
    return (
        f"this flexium (version {__version__}) cannot read the command the server sent ({_first_error(exc)}); "
        "the job's flexium and the server's are of versions that do not match: upgrade the older one"
    )


def _integer(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _epoch(value: object) -> float | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float
        return None


def _never_connected(exc: requests.RequestException) -> bool:
    """Whether the request failed before a connection was made (nothing was sent): a connect
    timeout, or a connection error whose cause is that no connection could be opened."""
    if isinstance(exc, requests.ConnectTimeout):
        return True
    cause = exc.args[0] if exc.args else None
    return isinstance(exc, requests.ConnectionError) and isinstance(
        getattr(cause, "reason", cause), urllib3.exceptions.NewConnectionError
    )


def _short(exc: BaseException) -> str:
    """requests' messages nest the whole urllib3 chain; the innermost reason is what helps."""
    if isinstance(exc, requests.ConnectTimeout):
        return "connection timed out"
    text = str(exc)
    verify = text.find("certificate verify failed")
    if verify >= 0:
        return text[verify:].split(" (_ssl")[0][:200]
    for marker in (
        "Connection refused",
        "Name or service not known",
        "Temporary failure in name resolution",
        "No route to host",
        "Connection reset by peer",
        "Remote end closed connection",
    ):
        if marker in text:
            return marker.lower()
    return text[:200]
