"""Serve one of the node's local HTTP faces (the OpenAI endpoint, the dashboard) on hypercorn
on trio, in the task group of the service that calls it: bound before `task_status.started`,
a port in use one PsymeshError (raised outside any exception group, so the caller can catch
it), served until cancelled."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import anyio
import anyio.abc
from starlette.types import ASGIApp

from ...protocol.errors import ErrorCode, PsymeshError

GRACEFUL_TIMEOUT_S = 2.0  # open requests get this long at shutdown


def os_error(exc: BaseException) -> OSError | None:
    """The OSError in `exc`, however deep in exception groups."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        return next((found for e in exc.exceptions if (found := os_error(e)) is not None), None)
    return None


async def serve_face(app: ASGIApp, host: str, port: int, *, what: str, port_hint: str, errorlog: str,
                     on_listening: Callable[[str], None],
                     task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on host:port. Once bound, `on_listening(url)` (http://HOST:PORT), then
    `task_status.started()`. `what` and `port_hint` make the message of a failed bind."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger(errorlog)
    config.graceful_timeout = GRACEFUL_TIMEOUT_S
    failure: PsymeshError | None = None
    async with anyio.create_task_group() as tg:
        try:
            binds = await tg.start(functools.partial(serve, app, config))  # type: ignore[arg-type]
        except Exception as exc:  # hypercorn's nursery hands a bind failure over in a group
            failed = os_error(exc)
            if failed is None:
                raise
            failure = PsymeshError(f"{what} cannot listen on {config.bind[0]}: {failed.strerror or failed}; "
                                   f"choose another port ({port_hint})", code=ErrorCode.UNAVAILABLE)
        else:
            on_listening(binds[0])
            task_status.started()
    if failure is not None:
        raise failure
