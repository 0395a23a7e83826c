"""The commands that talk to a server (`flexium ps | devices | migrate | pause | resume`): their
connection options, the connection (``flexium.client.ApiClient``, through which every request
goes), and what a failure of the server or of the request ends with (cli/exit_status.py).

Each such command's module sets its function on its parser (``on_server``); ``run`` connects and
calls it."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from pydantic import ValidationError

from flexium import protocol, reasons
from flexium.cli.exit_status import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_UNREACHABLE, EXIT_USAGE, UsageError, fail
from flexium.cli.waiting import Following
from flexium.client.http import ApiClient, LateAnswer, ServerError, Unauthorized, Unreachable
from flexium.errors import ConfigError

_TOKEN_TEXT = re.compile(r"[\x21-\x7e]+")  # sent in an HTTP header: printable ASCII, no blanks

OnServer = Callable[[ApiClient, argparse.Namespace], int]


def add_connection_options(parser: argparse.ArgumentParser, on_server: OnServer, *, json_output: bool = True) -> None:
    """``json_output``: whether the verb offers --json (not one whose output is its job's own)."""
    parser.add_argument(
        "--server",
        metavar="ADDRESS",
        help=f"host[:port]/workspace (default ${protocol.SERVER_ENV}, else 'server:' in .flexiumrc)",
    )
    parser.add_argument("--token", help=f"workspace token (default ${protocol.TOKEN_ENV}, else 'token:' in .flexiumrc)")
    if json_output:
        parser.add_argument("--json", action="store_true", help="print JSON (the server's objects) for scripts")
    else:
        parser.set_defaults(json=False)
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="a refusal with every reason, not only the one that matters"
    )
    parser.set_defaults(on_server=on_server)


def run(args: argparse.Namespace) -> int:
    Following.what = None  # nothing is followed before this command sends anything
    try:
        api = connect(args.server, args.token)
    except ConfigError as exc:
        return fail(str(exc), EXIT_USAGE, as_json=args.json, code="bad_settings")
    try:
        on_server: OnServer = args.on_server
        return on_server(api, args)
    except LateAnswer as exc:
        # The request reached the server, which may have carried it out before its answer was late.
        done = f" {_goes_on()}." if Following.what else ""
        return fail(
            f"{exc.message}.{done} What was asked may have been done all the same (a command sent, a wait "
            "queued): `flexium ps` shows it before you ask again",
            EXIT_UNREACHABLE,
            as_json=args.json,
            code=exc.code,
        )
    except Unreachable as exc:
        return fail(
            f"{exc.message} (is `flexium server` running there?)", EXIT_UNREACHABLE, as_json=args.json, code=exc.code
        )
    except Unauthorized as exc:
        # No token at all is a setting missing here (2), as no server is; a token refused is the server's answer (1).
        status = EXIT_USAGE if not api.token and exc.status != 403 else EXIT_FAILED
        return fail(_token_problem(api, exc), status, as_json=args.json, code=exc.code)
    except ServerError as exc:
        short = None if args.verbose else _one_reason(exc)
        return fail(exc.message, EXIT_FAILED, as_json=args.json, code=exc.code, short=short)
    except UsageError as exc:
        return fail(str(exc), EXIT_USAGE, as_json=args.json, code="bad_usage")
    except ValidationError as exc:  # what the server would refuse as invalid_request
        first = exc.errors()[0]
        if first["loc"][-1:] == ("process_id",):
            message = f"{first.get('input')!r} is not a process id: `flexium ps` lists them"
        else:
            message = f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
        return fail(message, EXIT_FAILED, as_json=args.json, code="invalid_request")
    except KeyboardInterrupt:
        goes_on = f": {_goes_on()}" if Following.what else ""
        return fail(f"interrupted{goes_on}", EXIT_INTERRUPTED, as_json=args.json, code="interrupted")
    finally:
        api.close()


def _goes_on() -> str:
    """What the command line was following when it stopped, which the server carries on."""
    return f"{Following.what} goes on at the server"


def _one_reason(refused: ServerError) -> str | None:
    """A process that cannot be moved, said by the one reason that matters (the server's message
    lists every problem the process reports: a CPU job's is hundreds of characters); None when
    no reason is known to matter most."""
    if refused.code != "capability":
        return None
    known = reasons.known_reason(refused.message)
    if known is None:
        return None
    head, said, _ = refused.message.partition(": ")
    return f"{head if said else 'refused'}: {known} (--verbose: every reason)"


def _token_problem(api: ApiClient, refused: Unauthorized) -> str:
    """A refused token, said in the CLI's terms (where a token comes from), not HTTP's."""
    where = f"{protocol.TOKEN_ENV}, --token or 'token:' in .flexiumrc"
    if refused.status == 403:
        return f"the token is not allowed to do this in workspace '{api.workspace}': {refused.message}"
    if not api.token:
        return (
            f"no token for workspace '{api.workspace}': set {where} (`flexium server` prints the first token "
            "when it creates a workspace; `flexium token issue WORKSPACE` makes another)"
        )
    return (
        f"the server at {api.base_url} does not accept this token for workspace '{api.workspace}' "
        f"(wrong, revoked, or of another workspace): set {where} to a token of workspace '{api.workspace}'"
    )


def connect(server: str | None, token: str | None) -> ApiClient:
    from flexium import __version__
    from flexium.config import load_config, parse_server_address

    if server is not None:
        parse_server_address(server, where="(from --server)")
    if token is not None and not _TOKEN_TEXT.fullmatch(token.strip()):
        raise ConfigError(
            "--token is empty or holds blanks or non-ASCII characters: give a token of the workspace (flx_...) as "
            f"`flexium server` or `flexium token issue` printed it, or leave --token out to use ${protocol.TOKEN_ENV}"
        )
    config = load_config(orchestrator=server, token=token)
    if config.address is None:
        raise ConfigError(
            f"no server configured: set {protocol.SERVER_ENV}=host[:port]/workspace "
            "(e.g. 127.0.0.1:8080/default), 'server:' in .flexiumrc, or pass --server"
        )
    return ApiClient(
        config.address, config.token or None, user_agent=f"flexium/{__version__} {protocol.CLI_AGENT_MARK}"
    )
