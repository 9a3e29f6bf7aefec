"""The app on a real loopback socket, for the server's tests."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from edgeprefill.runtime.api.runtime import Runtime

KEY = "test-key"


@contextmanager
def serving(
    make_backend: Callable[..., Any],
    policy: str = "static:64",
    n_seq_max: int = 4,
    server: dict[str, Any] | None = None,
    **build_options: Any,
) -> Iterator[tuple[str, Runtime]]:
    """The app on 127.0.0.1 at a free port, with an API key and `server`'s other
    `ServerOptions`; its runtime stopped after. A policy that needs the device's profile
    gets it measured now."""
    from edgeprefill.runtime.server.app import ServerOptions
    from edgeprefill.runtime.server.guard import LOOPBACK_NAMES
    from edgeprefill.runtime.server.serve import build, uvicorn_config

    be = make_backend(n_ctx=4096, n_seq_max=n_seq_max, batching="fast")
    profile = "probe" if policy.startswith("cadence") else None
    options = ServerOptions(api_key=KEY, model_id="tiny", hosts=LOOPBACK_NAMES, **(server or {}))
    served = build(be, policy, profile=profile, options=options, **build_options)  # type: ignore[arg-type]
    runtime = served.runtime
    srv = uvicorn.Server(uvicorn_config(served, "127.0.0.1", 0))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", runtime
    finally:
        srv.should_exit = True
        thread.join(30)
        served.close(cancel=True)


def curl_post(url: str, body: dict[str, Any], key: str | None = None) -> str:
    """POST `body` as JSON with curl, as a user at a shell would (unbuffered, so a stream
    arrives as it is sent); what curl printed."""
    args = ["curl", "-sN", url, "-H", "Content-Type: application/json", "-d", json.dumps(body)]
    if key is not None:
        args += ["-H", f"Authorization: Bearer {key}"]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
