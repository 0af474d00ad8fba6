"""@with_cancellation: a handler that stops when its client goes away (vLLM's decorator of
the same name). Cancelling the handler's task closes its engine streams, which aborts
their requests, so a client that leaves stops costing compute at once."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec

from starlette.requests import Request
from starlette.responses import Response

P = ParamSpec("P")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client left first"; nobody reads it


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _close_unsent(work: asyncio.Future) -> None:
    """A response made just before the race was lost is never sent: close what it holds."""
    if work.cancelled() or work.exception() is not None:
        return
    close = getattr(work.result(), "close_streams", None)
    if close is not None:
        asyncio.ensure_future(close())


def with_cancellation(handler: Callable[P, Awaitable[Response]]) -> Callable[P, Awaitable[Response]]:
    """Race handler(...) against the disconnect of the Request among its arguments.

    The request body must have been read before the handler is called: the disconnect
    listener reads the ASGI receive channel, which also carries the body."""

    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> Response:
        request = next(a for a in (*args, *kwargs.values()) if isinstance(a, Request))
        work = asyncio.ensure_future(handler(*args, **kwargs))
        disconnected = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this task itself was cancelled (shutdown): take the work along
            work.cancel()
            work.add_done_callback(_close_unsent)
            raise
        finally:
            disconnected.cancel()
        if work in done:
            return work.result()
        work.cancel()
        await asyncio.wait({work})  # its own cleanup runs; a cancel of this task still propagates
        _close_unsent(work)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    return wrapper
