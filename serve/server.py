"""Running the app on a TCP port until SIGTERM / SIGINT (or a stop event), then shutting down gracefully."""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Callable

from aiohttp import web

from serve.connections import ConnectionLimits, LimitedAppRunner, resolve_limits

logger = logging.getLogger(__name__)

HANDLER_GRACE_S = 5.0  # after the drain, how long handlers get to write their last event


async def start_server(app: web.Application, host: str, port: int,
                       limits: ConnectionLimits | None = None) -> tuple[LimitedAppRunner, int]:
    """Starts listening (port 0 picks a free port); returns the runner and the bound port.

    Handlers are cancelled when their client disconnects, which aborts the engine requests.
    Connections are held to `limits` (defaults: ConnectionLimits(); `runner.limits` has the resolved
    values) and the process's soft open-file limit is raised towards the hard one.
    """
    runner = LimitedAppRunner(app, limits=resolve_limits(limits), handler_cancellation=True,
                              shutdown_timeout=HANDLER_GRACE_S, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = runner.addresses[0][1]
    return runner, bound_port


async def serve_until_stopped(app: web.Application, host: str, port: int, *, stop: asyncio.Event | None = None,
                              on_ready: Callable[[int], None] | None = None,
                              limits: ConnectionLimits | None = None) -> None:
    """Serves until `stop` is set or the process gets SIGTERM / SIGINT (when run in the main thread).

    Shutdown: stop accepting, let in-flight requests finish within the app's drain timeout, end
    the rest with an error event, then shut the engine down.
    """
    stop = stop or asyncio.Event()
    runner, bound_port = await start_server(app, host, port, limits)
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        logger.info("serving on http://%s:%d (at most %d connections)", host, bound_port,
                    runner.limits.max_connections)
        if on_ready is not None:
            on_ready(bound_port)
        await stop.wait()
        logger.info("shutting down")
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await runner.cleanup()
