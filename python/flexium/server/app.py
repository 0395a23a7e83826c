"""The server application: ``create_app(settings)`` builds the ASGI app (tests use it with their
own settings); ``serve(settings)`` runs it, for ``flexium server`` (cli/server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import gc
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, IntegrityError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flexium import protocol
from flexium.server import replicas, services, sole_server, storage
from flexium.server.connection_book import ConnectionBook, TrustedProxies
from flexium.server.connections import (
    bounded_protocol,
    connection_limit,
    listening_socket,
    raise_open_file_limit,
    tls_context,
)
from flexium.server.context import ServerContext
from flexium.server.dashboard import install_dashboard
from flexium.server.db import Database, DatabaseUnavailable, SchemaTooNew, redacted, require_folder
from flexium.server.errors import ApiError, TooManyRequests, Unauthorized
from flexium.server.fair_share import FairShare
from flexium.server.heartbeat_shortcut import HeartbeatShortcut
from flexium.server.loop_watch import LoopWatch
from flexium.server.refusals import request_refused
from flexium.server.routes import api, system
from flexium.server.routes.docs import install_docs
from flexium.server.settings import Settings, load_settings, sqlite_file
from flexium.server.sole_server import ServedElsewhere
from flexium.server.storage import quotas, retention
from flexium.server.tls_certificate import check_certificate
from flexium.server.transport_security import StrictTransportSecurity

log = logging.getLogger("flexium.server")

_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "bad_request",
    409: "invalid_state",
    413: "payload_too_large",
    415: "bad_request",
    422: "invalid_request",
    429: "too_many_requests",
}


def _error(status: int, code: str, message: str, detail: Any = None) -> JSONResponse:
    body: dict[str, Any] = {"error": code, "message": message}
    if detail is not None:
        body["detail"] = detail
    return JSONResponse(body, status_code=status)


class BodyLimit:
    """Refuse bodies over the limit with 413 before anything parses them. A body without
    Content-Length (chunked) is read here up to the limit and replayed."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                length = value
                break
        too_large = _error(413, "payload_too_large", f"request body over {self.max_bytes} bytes")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                await too_large(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if scope.get("method") in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await too_large(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _validation_message(errors: Sequence[Any]) -> tuple[int, str, str, list[dict[str, Any]]]:
    detail = []
    for err in errors[:20]:
        loc = [str(p) for p in err.get("loc", ())]
        detail.append({"loc": loc, "msg": str(err.get("msg", ""))[:300], "type": err.get("type", "")})
    if any(d["type"] == "json_invalid" for d in detail):
        return 400, "bad_request", "malformed JSON body", detail
    first = detail[0] if detail else {"loc": [], "msg": "invalid request"}
    where = ".".join(p for p in first["loc"] if p not in ("body",)) or "request"
    more = f" (and {len(detail) - 1} more)" if len(detail) > 1 else ""
    return 422, "invalid_request", f"{where}: {first['msg']}{more}", detail


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        request_refused(_request, exc)
        answer = _error(exc.status, exc.code, exc.message, exc.detail)
        if isinstance(exc, Unauthorized):
            answer.headers["WWW-Authenticate"] = exc.challenge
        if isinstance(exc, TooManyRequests):
            answer.headers["Retry-After"] = str(exc.retry_after_s)
        return answer

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        status, code, message, detail = _validation_message(exc.errors())
        return _error(status, code, message, detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _STATUS_CODES.get(exc.status_code, "bad_request" if exc.status_code < 500 else "internal")
        message = exc.detail if isinstance(exc.detail, str) else "request refused"
        if exc.status_code == 404 and message == "Not Found":
            message = "no such endpoint"
        return JSONResponse(
            {"error": code, "message": message}, status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(DatabaseUnavailable)
    async def _db_down(_request: Request, exc: DatabaseUnavailable) -> JSONResponse:
        log.warning("database unavailable: %s", exc)
        answer = _error(503, "unavailable", f"database unavailable: {exc}")
        answer.headers["Retry-After"] = "1"
        return answer

    @app.exception_handler(IntegrityError)
    async def _integrity(_request: Request, exc: IntegrityError) -> JSONResponse:
        log.info("conflicting concurrent change: %s", exc.orig)
        return _error(409, "busy", "a concurrent request changed the same thing; retry")

    @app.exception_handler(DataError)
    async def _data(_request: Request, exc: DataError) -> JSONResponse:
        # Validation should have caught it; this keeps a value the database refuses a 4xx.
        log.warning("database refused a value: %s", exc.orig)
        return _error(
            422, "invalid_request", "a value could not be stored: " + str(exc.orig).strip().splitlines()[0][:200]
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return _error(500, "internal", f"internal error ({type(exc).__name__}); see the server log")


def create_app(settings: Settings | None = None, *, database: Database | None = None, upgrade: bool = True) -> FastAPI:
    """The ASGI app. Upgrades the schema first (unless ``upgrade=False``)."""
    settings = settings or load_settings()
    db = database or Database(
        settings.database_url, threads=settings.threads, lock_timeout_s=settings.db_lock_timeout_s
    )
    db.session_info[quotas.SESSION_KEY] = quotas.Quotas.of(settings)
    db.session_info[retention.SESSION_KEY] = retention.Retention.of(settings)
    if upgrade:
        db.upgrade(new_database=settings.new_database)
    ctx = ServerContext(settings=settings, db=db)
    if db.migration_seconds is not None:
        ctx.metrics.schema_migration.observe(db.migration_seconds)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        ctx.loop = asyncio.get_running_loop()
        watch = LoopWatch(ctx.metrics)
        watch.start()
        for ws, process_id, command_id in await db.call(storage.pending_commands, write=False):
            ctx.command_pending(ws, process_id, command_id)
        for ws, process_id, snapshot in await db.call(storage.load_snapshots, write=False):
            ctx.process_seen_here(ws, process_id, snapshot)
        db.start_checkpoints()
        if not db.is_sqlite:  # several servers may share the database: each tells the others
            await replicas.start_link(ctx)
        tasks = [asyncio.create_task(services.sweep_forever(ctx)), asyncio.create_task(ctx.flush_forever())]
        try:
            yield
        finally:
            ctx.begin_shutdown()
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            with contextlib.suppress(Exception):
                await ctx.flush_beats()
            with contextlib.suppress(Exception):
                await ctx.flush_token_use()
            await asyncio.to_thread(replicas.stop_link, ctx)
            db.stop_checkpoints()
            await watch.stop()
            if database is None:
                db.dispose()

    app = FastAPI(
        title="flexium server",
        version=str(protocol.PROTOCOL_VERSION),
        description="Processes, GPUs and commands of flexium training jobs. "
        "Every /api call carries `Authorization: Bearer <workspace token>` (Authorize, above, sends it).",
        lifespan=lifespan,
        docs_url=None,  # served by routes.docs, with local assets
        redoc_url=None,
    )
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(system.router)
    app.include_router(api.router)
    install_dashboard(app)
    install_docs(app)
    app.add_middleware(HeartbeatShortcut, ctx=ctx)
    app.add_middleware(StrictTransportSecurity)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(
        FairShare,
        ctx=ctx,
        max_requests=settings.max_requests,
        job_request_share=settings.job_request_share,
        max_requests_per_client=settings.max_requests_per_client,
        max_streams_per_token=settings.max_streams_per_token,
    )  # outermost
    return app


def tune_gc() -> None:
    """Fewer, cheaper garbage collections: with thousands of open connections a full
    collection walks every long-lived object and stalls every request for a few hundred ms.
    What exists at start (modules, the app) is frozen out of collections; the young
    generation is collected less often. Reference cycles are still collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def bootstrap(db: Database) -> str | None:
    """On a database without workspaces, create ``default``; its token, or None."""
    return db.run(storage.ensure_default_workspace, write=True, now=time.time())


def _print_first_tokens(db: Database, settings: Settings, admin_token: str) -> None:
    """A new database's first start: a login link, a job token for training jobs (it registers
    and reports its own processes, and cannot command or mint) and the admin token, alone on
    the last line for scripts."""
    link = settings.link_base
    now = time.time()
    code = db.run(storage.login_code_for, write=True, token=admin_token, now=now)
    workspace = db.run(storage.get_workspace, write=False, name=protocol.DEFAULT_WORKSPACE)
    job_token = db.run(
        storage.issue_token,
        write=True,
        workspace_id=workspace.id,
        name="training jobs",
        role=protocol.ROLE_JOB,
        now=now,
    ).token
    print(
        f"flexium server: created workspace '{protocol.DEFAULT_WORKSPACE}'. Log in to the dashboard: "
        f"{link}/login#code={code} (works once, within {storage.LOGIN_CODE_TTL_S / 60:.0f} min; "
        "else paste the admin token below)"
    )
    job_host = settings.host if settings.host not in ("0.0.0.0", "::") else "<this host>"
    scheme = "https://" if settings.certfile else ""  # plain host:port means http
    address = f"{scheme}{job_host}:{settings.port}/{protocol.DEFAULT_WORKSPACE}"
    print(
        f"flexium server: training jobs: {protocol.SERVER_ENV}={address} {protocol.TOKEN_ENV}={job_token}  "
        "(a job token, shown once; "
        f"`flexium token issue {protocol.DEFAULT_WORKSPACE} --role job` makes another)"
    )
    print(
        f"flexium server: admin token of workspace '{protocol.DEFAULT_WORKSPACE}', for the command line and the "
        "dashboard (shown once):"
    )
    print(admin_token)


def serve(settings: Settings) -> int:
    """Upgrade the schema, create the default workspace on an empty database, print where the
    dashboard is, and serve until a stop signal; returns the exit status."""
    tls = check_certificate(settings.certfile, settings.keyfile, now=time.time())
    if tls.problem is not None:
        print(f"flexium server: {tls.problem}", file=sys.stderr)
        return 1
    if tls.warning is not None:
        print(f"flexium server: {tls.warning}", file=sys.stderr)
    try:
        listening = listening_socket(settings.host, settings.port)
    except OSError as exc:
        why = (exc.strerror or str(exc)).lower()
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            advice = "that is not an address of this machine: check --host (0.0.0.0 listens on all of them)"
        else:
            advice = "another program, or another flexium server, may use that port: choose another with --port"
        print(f"flexium server: cannot listen on {settings.host}:{settings.port}: {why}; {advice}", file=sys.stderr)
        return 1
    if settings.port == 0:  # the port the system chose, in every link printed
        settings = dataclasses.replace(settings, port=listening.getsockname()[1])
    database_file = sqlite_file(settings.database_url)
    if database_file is not None:
        try:
            require_folder(database_file)
            # kept open while this process lives: the lock is the file descriptor's
            sole_server.claim(database_file, address=f"{settings.host}:{settings.port}", link=settings.link_base)
        except (ServedElsewhere, DatabaseUnavailable, OSError) as exc:
            listening.close()
            print(f"flexium server: {exc}", file=sys.stderr)
            return 1
    try:
        db = Database(settings.database_url, threads=settings.threads, lock_timeout_s=settings.db_lock_timeout_s)
        seconds = db.upgrade(new_database=settings.new_database)
        token = bootstrap(db) if settings.bootstrap_default_workspace else None
    except (DatabaseUnavailable, SchemaTooNew) as exc:
        listening.close()
        print(f"flexium server: cannot use the database {redacted(settings.database_url)}: {exc}", file=sys.stderr)
        return 1
    app = create_app(settings, database=db, upgrade=False)
    app.state.ctx.metrics.schema_migration.observe(seconds)
    link = settings.link_base
    print(f"flexium server: database {redacted(settings.database_url)} (schema ready in {seconds:.2f} s)")
    print(f"flexium server: dashboard {link}/  API {link}{protocol.API_PREFIX}/w/<workspace>/  docs {link}/docs")
    if token is not None:
        _print_first_tokens(db, settings, token)
    sys.stdout.flush()

    open_files = raise_open_file_limit()
    max_connections = connection_limit(settings.max_connections, open_files)
    print(
        f"flexium server: open file limit {open_files}: up to {max_connections} connections "
        f"({settings.max_connections_per_client} from one address), {settings.max_requests} requests in progress; "
        f"a request must arrive within {settings.request_timeout_s:g} s of its connection"
    )
    sys.stdout.flush()
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        ws="none",  # no WebSocket routes: an Upgrade request is plain HTTP, under the request bound
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_keep_alive=75,
        timeout_graceful_shutdown=3,
        backlog=4096,
        lifespan="on",
    )
    # TLS is ours, not the event loop's: connections.py counts and times a connection from its
    # accept, its handshake included. Trusted proxies are uvicorn's (FORWARDED_ALLOW_IPS).
    book = ConnectionBook(
        max_connections=max_connections,
        max_per_client=settings.max_connections_per_client,
        trusted_proxies=TrustedProxies(config.forwarded_allow_ips),
    )
    config.http = bounded_protocol(
        request_timeout_s=settings.request_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        max_header_bytes=settings.max_header_bytes,
        max_header_lines=settings.max_header_lines,
        book=book,
        tls=tls_context(settings.certfile, settings.keyfile) if settings.certfile and settings.keyfile else None,
    )
    ctx = app.state.ctx

    class Server(uvicorn.Server):
        """Told about a stop signal first, so that waiting long-polls and event streams end at
        once instead of holding the graceful shutdown for their full timeout."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if ctx.loop is not None and not ctx.loop.is_closed():
                ctx.loop.call_soon_threadsafe(ctx.begin_shutdown)
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if sockets is not None and self.started:  # uvicorn says where it serves only on sockets it bound itself
                self._log_started_message(sockets)

        def _log_started_message(self, listeners: Sequence[Any]) -> None:
            """uvicorn's start line, with the scheme served: uvicorn would say http under
            --certfile, since the TLS is ours (connections.py), not its own."""
            host = f"[{settings.host}]" if ":" in settings.host else settings.host
            port = settings.port or listeners[0].getsockname()[1]
            logging.getLogger("uvicorn.error").info(
                "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", settings.scheme, host, port
            )

    server = Server(config)
    tune_gc()
    try:
        server.run(sockets=[listening])
    except KeyboardInterrupt:
        # uvicorn shut down gracefully, then raised the Ctrl-C again for whoever called it: here
        # that is the person at the terminal, who asked for the stop and needs no traceback.
        print("flexium server: stopped", flush=True)
    finally:
        db.dispose()
    return 0 if server.started else 1
