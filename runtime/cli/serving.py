"""`edgeprefill serve`'s own options, and the server's settings made from them."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import cloup

from edgeprefill.runtime.cli.options import Decorator
from edgeprefill.runtime.policies import DEFAULT_POLICY
from edgeprefill.runtime.runner.devices.kind import option

log = logging.getLogger(__name__)

API_KEY_ENV = "EDGEPREFILL_API_KEY"


def server_options() -> Decorator:
    def apply(f: Callable[..., Any]) -> Callable[..., Any]:
        return _serve_group()(_limits_group()(f))

    return apply


def _serve_group() -> Any:
    return cloup.option_group(
        "Serve",
        option("--host", "127.0.0.1", "address to listen on"),
        option("--port", 8080, type=click.IntRange(0, 65535)),
        option(
            "--api-key",
            help=f"require 'Authorization: Bearer KEY' (all but /health); better from "
            f"${API_KEY_ENV}, since a command line is visible to every local user",
            envvar=API_KEY_ENV,
        ),
        option(
            "--allowed-host",
            help="a name clients may reach the server by, besides localhost, 127.0.0.1 and "
            "::1 (repeatable); other Host headers are refused on a loopback address, against "
            "DNS rebinding",
            multiple=True,
        ),
        option("--policy policy_spec", DEFAULT_POLICY, "prefill budget policy, as for `run`"),
        option("--served-model-name", help="the model id clients send [default: file name]"),
        option(
            "--parse-special",
            False,
            "read the model's control tokens (e.g. <start_of_turn>) in chat text; off, "
            "they are plain text a user cannot forge turns with",
            is_flag=True,
        ),
        option(
            "--allowed-origin",
            help="a web origin (scheme://host:port) whose pages may call the server, besides "
            "its own page (repeatable); requests from other pages' origins are refused",
            multiple=True,
        ),
        option(
            "--cancel-on-shutdown",
            False,
            "at Ctrl-C or SIGTERM end the chats in flight at once, rather than finish them",
            is_flag=True,
        ),
        option(
            "--finish-documents-on-shutdown",
            False,
            "at Ctrl-C or SIGTERM read the queued documents before exiting (their answers "
            "go only to --results), rather than cancel them",
            is_flag=True,
        ),
        option(
            "--shutdown-timeout",
            10.0,
            "seconds the chats in flight have to finish at Ctrl-C or SIGTERM, after which "
            "they end, whatever their clients do",
            type=click.FloatRange(0, 3600),
        ),
        option(
            "--results",
            help="write requests.jsonl, iterations.jsonl and summary.json here, as `run` does",
            type=click.Path(file_okay=False, path_type=Path),
        ),
    )


def _queue_limit(flag: str, default: int | None, waiting: str) -> Decorator:
    """A class's own queue bound (a backlog of documents never turns a chat away)."""
    unset = " [default: no limit]" if default is None else ""
    help = f"most {waiting} waiting for a sequence; past it 429 with Retry-After{unset}"
    return option(flag, default, help, type=click.IntRange(0))


def _limits_group() -> Any:
    return cloup.option_group(
        "Server limits",
        _queue_limit("--max-queue", None, "chats"),
        _queue_limit("--max-document-queue", 256, "documents (and other background requests)"),
        option("--max-body-mb", 8.0, "largest request body", type=click.FloatRange(0, 4096)),
        option(
            "--max-connections",
            256,
            "most requests answered at once; past it 503 (/health is always answered; idle "
            "connections are not counted, and are closed after their deadline)",
            type=click.IntRange(1),
        ),
        option(
            "--client-timeout",
            30.0,
            "seconds a client may take to send its body, or leave a stream unread, before "
            "its connection is closed (headers: 10 s; idle between requests: 5 s)",
            type=click.FloatRange(1, 3600),
        ),
        option(
            "--documents-kept",
            256,
            "finished documents kept answerable by id, the least recently used forgotten",
            type=click.IntRange(0),
        ),
    )


def server_settings(o: dict[str, Any], model_id: str) -> Any:
    """The `ServerOptions` of the command line's options (which it removes from `o`)."""
    from edgeprefill.runtime.server.admission import QueueLimits
    from edgeprefill.runtime.server.app import ServerOptions
    from edgeprefill.runtime.server.connections import Deadlines
    from edgeprefill.runtime.server.guard import LOOPBACK_NAMES

    extra = frozenset(h.lower() for h in o["allowed_host"])
    if _loopback(o["host"]):
        hosts: frozenset[str] | None = LOOPBACK_NAMES | extra
    else:
        hosts = extra or None
        if o["api_key"] is None:
            log.warning(
                "serving on %s without an API key: anyone who can reach it can use the model "
                "and read the documents' answers (set $%s)",
                o["host"],
                API_KEY_ENV,
            )
    client_s = o["client_timeout"]
    return ServerOptions(
        api_key=o["api_key"],
        model_id=model_id,
        queue=QueueLimits(o["max_queue"], o["max_document_queue"]),
        max_body_bytes=int(o["max_body_mb"] * (1 << 20)),
        hosts=hosts,
        documents_kept=o["documents_kept"],
        parse_special=o["parse_special"],
        origins=frozenset(_origin(x) for x in o["allowed_origin"]),
        max_requests=o["max_connections"],
        deadlines=Deadlines(body_s=client_s, write_stall_s=client_s),
        shutdown_timeout_s=o["shutdown_timeout"],
        finish_documents=o["finish_documents_on_shutdown"],
    )


def _origin(text: str) -> str:
    """An origin as browsers send it: scheme://host[:port], lower case, no path."""
    origin = text.strip().lower().rstrip("/")
    scheme, sep, rest = origin.partition("://")
    if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
        raise click.BadParameter(
            f"{text!r} is not a web origin: give scheme://host[:port], e.g. http://localhost:3000",
            param_hint="--allowed-origin",
        )
    return origin


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
