"""A bound on every send to an HTTP client: a client that stops reading is cut off, and its request ends with it
(a pure ASGI middleware, outside every other one); and one on a request's body (``BodyTimeout``): a client that
trickles it gets a 408.

uvicorn's ``send`` waits for the socket to drain with no time limit, so a client that stops reading would hold
its request, and the engine slot a streamed chat holds, for as long as it keeps the connection open. Here a
send that has not drained within ``timeout_s`` is given up: the app's task unwinds (a streamed chat closes its
engine stream, which aborts the request in the engine and frees its slot), the connection is closed, the
stall is counted (``on_stall``) and, once per process, logged.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging

logger = logging.getLogger("kvmem.server")

# uvicorn's own line for an app that returned with its response unfinished: expected here, said once by us
_UNFINISHED = "ASGI callable returned without completing response."
_stalled: contextvars.ContextVar[bool] = contextvars.ContextVar("kvmem_stalled", default=False)
_logged = False


class ClientStalled(Exception):
    """A send to the client did not drain within the bound."""


class _QuietUnfinished(logging.Filter):
    """Drops uvicorn's "returned without completing response" line for a connection cut off here (the app runs in
    uvicorn's task, so the flag set in it is seen by uvicorn's log call in the same task)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_stalled.get() and record.getMessage() == _UNFINISHED)


logging.getLogger("uvicorn.error").addFilter(_QuietUnfinished())


class SendTimeout:
    """ASGI middleware: each ``http.response.*`` send waits at most ``timeout_s`` seconds for the client to take
    the bytes; past it the app is stopped (ClientStalled raised from its send, or its task cancelled by the
    middlewares inside), the response is left unfinished (uvicorn closes the connection), and ``on_stall()``
    runs. The first stall in the process is logged (WARNING); later ones only count."""

    def __init__(self, app, timeout_s, on_stall=None):
        """``timeout_s``: seconds, or a function returning them (read per request: ``Limits.send_timeout_s``)."""
        self.app, self._timeout, self.on_stall = app, timeout_s, on_stall

    @property
    def timeout_s(self) -> float:
        return float(self._timeout() if callable(self._timeout) else self._timeout)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        stalled, bound = False, self.timeout_s

        async def bounded(message):
            nonlocal stalled
            if stalled:  # the app caught ClientStalled and tried again: the connection is being closed
                raise ClientStalled
            try:
                await asyncio.wait_for(send(message), bound)
            except TimeoutError:
                stalled = True
                raise ClientStalled from None

        try:
            await self.app(scope, receive, bounded)
        except ClientStalled:
            pass
        except Exception:
            if not stalled:
                raise
        if stalled:
            _stalled.set(True)
            self._stalled(scope, bound)

    def _stalled(self, scope, bound: float) -> None:
        global _logged
        if self.on_stall is not None:
            self.on_stall()
        if not _logged:
            _logged = True
            logger.warning(
                "a client stopped reading for %.0f s (%s %s): its request was aborted and its connection closed; "
                "further ones are counted in kvmem_send_timeouts_total, not logged",
                bound,
                scope.get("method"),
                scope.get("path"),
            )


class BodyTimeout:
    """ASGI middleware: a request's body must have arrived ``timeout_s`` seconds after its headers (uvicorn and
    h11 bound neither: a client that sends headers, then trickles its body, would hold a connection and its
    request for as long as it likes). Past the bound the client gets a 408 (OpenAI-shaped, ``request_timeout``,
    ``Connection: close``), the app sees the client gone (``http.disconnect``), and uvicorn closes the
    connection, whose body was never finished. A body complete in time is not bounded further; nor is waiting
    for a disconnect after it (a streamed response's)."""

    def __init__(self, app, timeout_s):
        """``timeout_s``: seconds, or a function returning them (read per request: ``Limits.body_timeout_s``)."""
        self.app, self._timeout = app, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        bound = float(self._timeout() if callable(self._timeout) else self._timeout)
        deadline, done, late, started = loop.time() + bound, False, False, False

        async def bounded_receive():
            nonlocal done, late
            if late:
                return {"type": "http.disconnect"}
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                late = True
                if not started:
                    await _answer_408(send, bound)
                return {"type": "http.disconnect"}
            done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def tracked_send(message):
            nonlocal started
            if late:  # the 408 was the answer
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracked_send)
        except Exception:
            if not late:
                raise


async def _answer_408(send, bound: float) -> None:
    body = json.dumps(
        {
            "error": {
                "message": f"the request body did not arrive within {bound:g} s",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 408, "headers": [*headers, (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
