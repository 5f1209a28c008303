"""A client of a toolpool service: ``toolpool.connect(url)`` (docs/service.md, "Remote callers").

It speaks the MCP streamable HTTP wire of the 2026-07-28 protocol, which is stateless: every
``tools/call`` is one POST, answered by one JSON-RPC message (as JSON, or as an event stream
that may carry progress first). Results come back as :class:`toolpool.Result`, their outcome
and ``body_started`` read from the answer's ``structuredContent`` (the MCP face's result
shape, docs/mcp.md).

What the client can and cannot know, said the same way the pool says it:

- **Never sent** (no connection, the server or the load balancer answered 503, or the service
  is draining): the call did not reach a tool. It raises :class:`ServerUnavailable`, and a
  caller may send it anywhere else (``toolpool batch --server`` does, to another server).
- **Lost** (the connection dropped after the request was sent, a gateway answered 502/504):
  the call settles ``worker_lost`` with ``body_started`` None, unless the server had said the
  body started (a progress notification comes only from a running body): then True.
- **Cancelled** (:meth:`RemoteCall.cancel`): the client posts ``notifications/cancelled``
  for the call. toolpool's face honours it when the call is in flight on that node: it
  cancels the call with cause ``user`` and answers the request once the call settled, so
  the result is the truthful one (``aborted``, ``killed`` once its tree is gone...). Where
  the cancel is not honoured (another server, another node behind a load balancer, a call
  that has not reached the face yet) the client closes the call's response stream, the
  2026-07-28 wire's cancel (the face then cancels with cause ``parent``); that request is
  not answered, so the call settles ``error`` named ``CancelUnconfirmed``, ``body_started``
  True if the server had said the body runs, else None.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from collections.abc import AsyncIterator, Generator, Iterable, Mapping
from types import TracebackType
from typing import Any, Final, final

import anyio
import anyio.abc

from ..core import Outcome, ToolpoolError, UnknownToolError, validate_cause
from ..supervisor import Result, Rung, Timeline

__all__ = (
    "PROTOCOL_VERSION",
    "Client",
    "RemoteCall",
    "RemoteError",
    "ServerUnavailable",
    "connect",
)

#: The MCP protocol version the client speaks.
PROTOCOL_VERSION: Final = "2026-07-28"
_ACCEPT: Final = "application/json, text/event-stream"
_LOST_STATUSES: Final = frozenset({502, 504})
_UNAVAILABLE_STATUSES: Final = frozenset({503})
#: The face's header saying it honoured a ``notifications/cancelled`` (``mcp/_http.py``).
_CANCEL_HEADER: Final = "toolpool-cancel"


#: The ``error_name`` of a call lost with its server: the connection dropped mid-call.
SERVER_LOST: Final = "ServerLost"


class ServerUnavailable(ToolpoolError):
    """The call was never sent to a tool: no connection, 503, or the service is draining.
    Safe to send again, anywhere."""


class RemoteError(ToolpoolError):
    """The server refused the request (an error answer, not a tool's outcome): a bad token,
    an unknown method, garbage."""


@final
class RemoteCall:
    """One call sent to a service: ``await call`` gives its :class:`toolpool.Result`."""

    def __init__(self, client: Client, call_id: int, tool: str, args: Mapping[str, Any]) -> None:
        self.client = client
        self.id = call_id
        self.tool = tool
        self.args = dict(args)
        self.body_started: bool | None = None
        """True once the server said the body runs (a progress notification)."""
        self._done = anyio.Event()
        self._result: Result | None = None
        self._error: BaseException | None = None
        self._cancel_reason: str | None = None
        self._reading: anyio.CancelScope | None = None
        """While the request is in flight: the scope whose cancel closes its stream."""
        self._submitted = time.monotonic()
        self._wire_id = f"{client._prefix}-{call_id}"
        """Its JSON-RPC request id: unique to its client (a cancel names it)."""

    def done(self) -> bool:
        """Whether the call settled (or failed to be sent)."""
        return self._done.is_set()

    def result(self) -> Result:
        """The settled result; raises what the call raised (:class:`ServerUnavailable`)."""
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RuntimeError("the call has not settled")
        return self._result

    async def wait(self) -> Result:
        """Wait until it settled; its result (if the task waiting is cancelled, the call is
        cancelled too, with the MCP cancel, and still tracked until it settles)."""
        try:
            await self._done.wait()
        except anyio.get_cancelled_exc_class():
            self.cancel("the caller went away")
            raise
        return self.result()

    def __await__(self) -> Generator[Any, None, Result]:
        return self.wait().__await__()

    def cancel(self, reason: str = "cancelled by the caller") -> None:
        """Send the MCP cancel for this call (once; later calls do nothing)."""
        if self._cancel_reason is None and not self.done():
            self._cancel_reason = reason
            if self._reading is not None:
                self.client._start_cancel(self)

    def __repr__(self) -> str:
        state = "settled" if self.done() else "running"
        return f"<toolpool.remote.RemoteCall {self.id} {self.tool!r} {state}>"


@final
class Client:
    """A connection to one toolpool service (``toolpool.connect(url)``); use it as an async
    context manager: leaving it cancels the calls still running and waits for their answers.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        max_connections: int = 100,
        connect_timeout: float = 10.0,
    ) -> None:
        """
        :param url: the service's MCP endpoint, ``http://host:port/mcp``.
        :param token: the bearer token, where the service wants one.
        :param max_connections: calls in flight at once over this client (one connection each).
        :param connect_timeout: seconds to get a connection; after it the call was never sent.
        """
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be http(s)://host:port/mcp, got {url!r}")
        self.url = url
        self._token = token
        self._max = max_connections
        self._connect_timeout = connect_timeout
        self._ids = itertools.count(1)
        # Request ids on the wire are unique to this client (a cancel names one).
        self._prefix = secrets.token_hex(8)
        self._http: Any = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._calls: set[RemoteCall] = set()

    async def __aenter__(self) -> Client:
        import httpx2

        self._http = httpx2.AsyncClient(
            timeout=httpx2.Timeout(None, connect=self._connect_timeout),
            limits=httpx2.Limits(max_connections=self._max, max_keepalive_connections=self._max),
        )
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for call in list(self._calls):
            call.cancel("the client is closing")
        assert self._tg is not None
        try:
            await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            await self._http.aclose()

    # ------------------------------------------------------------------ the API

    def submit(self, tool: str, args: Mapping[str, Any] | None = None) -> RemoteCall:
        """Send a call now; returns at once. ``await`` the call for its result."""
        if self._tg is None:
            raise RuntimeError("use the client in `async with toolpool.connect(url)`")
        call = RemoteCall(self, next(self._ids), tool, args or {})
        self._calls.add(call)
        self._tg.start_soon(self._run, call)
        return call

    async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> Result:
        """Submit and wait: the call's :class:`toolpool.Result`."""
        return await self.submit(tool, args).wait()

    async def cancel(self, call: RemoteCall, reason: str = "cancelled by the caller") -> Result:
        """Cancel ``call`` (the MCP cancel) and wait for its final result."""
        call.cancel(reason)
        return await call.wait()

    async def map(
        self, tool: str, args: Iterable[Mapping[str, Any]], *, concurrency: int = 16
    ) -> AsyncIterator[Result]:
        """Call ``tool`` once per argument mapping, ``concurrency`` at a time; the results
        in input order, each with ``index`` set."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        window: list[RemoteCall] = []
        source = iter(args)
        index = 0
        try:
            while True:
                while len(window) < concurrency:
                    item = next(source, None)
                    if item is None:
                        break
                    window.append(self.submit(tool, item))
                if not window:
                    return
                result = await window.pop(0).wait()
                yield _with_index(result, index)
                index += 1
        finally:
            for call in window:
                call.cancel("the map was left")

    async def list_tools(self) -> dict[str, dict[str, Any]]:
        """The service's tools by name (``tools/list``)."""
        answer = await self._request("tools/list", {}, name=None)
        return {t["name"]: t for t in answer.get("tools", [])}

    # ------------------------------------------------------------------ the wire

    def _headers(self, method: str, name: str | None) -> dict[str, str]:
        headers = {
            "content-type": "application/json",
            "accept": _ACCEPT,
            "mcp-protocol-version": PROTOCOL_VERSION,
            "mcp-method": method,
        }
        if name is not None:
            headers["mcp-name"] = name
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        return headers

    @staticmethod
    def _body(request_id: int | str | None, method: str, params: dict[str, Any]) -> bytes:
        params = {
            **params,
            "_meta": {
                **params.get("_meta", {}),
                "io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
                "io.modelcontextprotocol/clientInfo": {"name": "toolpool", "version": "1"},
                "io.modelcontextprotocol/clientCapabilities": {},
            },
        }
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
        if request_id is not None:
            message["id"] = request_id
        return json.dumps(message, separators=(",", ":")).encode()

    async def _request(self, method: str, params: dict[str, Any], *, name: str | None) -> Any:
        """A request that is not a tool call: its result, or an error raised."""
        import httpx2

        request_id = next(self._ids)
        try:
            response = await self._http.post(
                self.url,
                content=self._body(request_id, method, params),
                headers=self._headers(method, name),
            )
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
            raise ServerUnavailable(f"{self.url}: {exc}") from exc
        if response.status_code in _UNAVAILABLE_STATUSES:
            raise ServerUnavailable(f"{self.url}: HTTP {response.status_code}")
        message = await _answer(response, request_id, lambda _m: None)
        if message is None:
            raise RemoteError(f"{self.url}: no answer to {method}")
        return _result_or_raise(message, self.url)

    async def _run(self, call: RemoteCall) -> None:
        try:
            call._result = await self._send(call)
        except BaseException as exc:
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                call._error = ServerUnavailable("the client closed before the call was sent")
                raise
            call._error = exc
            if not isinstance(exc, Exception):
                raise
        finally:
            self._calls.discard(call)
            call._done.set()

    async def _send(self, call: RemoteCall) -> Result:
        import httpx2

        params = {
            "name": call.tool,
            "arguments": call.args,
            "_meta": {"progressToken": f"toolpool-{call.id}"},
        }
        body = self._body(call._wire_id, "tools/call", params)
        request = self._http.build_request(
            "POST", self.url, content=body, headers=self._headers("tools/call", call.tool)
        )

        def on_message(message: Mapping[str, Any]) -> None:
            if message.get("method") == "notifications/progress":
                call.body_started = True

        message = None
        status = 0
        text = ""
        failure: BaseException | None = None
        # A cancel may come before the answer starts (the face commits its stream only with
        # the first progress, or after 15 s): from here on it is sent at once.
        call._reading = reading = anyio.CancelScope()
        if call._cancel_reason is not None:
            self._start_cancel(call)
        try:
            with reading:
                response = await self._http.send(request, stream=True)
                try:
                    status = response.status_code
                    if status >= 400 and status not in _LOST_STATUSES:
                        text = (await response.aread()).decode(errors="replace")[:500]
                    elif status < 400:
                        message = await _answer(response, call._wire_id, on_message)
                finally:
                    with anyio.CancelScope(shield=True):
                        await response.aclose()
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
            failure = exc
        except httpx2.TransportError as exc:
            text = str(exc)
            status = -1
        finally:
            call._reading = None
        if failure is not None:
            raise ServerUnavailable(f"{self.url}: {failure}") from failure
        if status == -1:
            return self._lost(call, f"the connection to {self.url} was lost: {text}")
        if status in _UNAVAILABLE_STATUSES:
            raise ServerUnavailable(f"{self.url}: HTTP {status} (the call was not sent)")
        if status in _LOST_STATUSES:
            return self._lost(
                call, f"{self.url}: HTTP {status} from a gateway: the server went away"
            )
        if status >= 400:
            raise RemoteError(f"{self.url}: HTTP {status}: {text}")
        if message is None:
            if call._cancel_reason is not None:
                return self._unconfirmed(call)
            return self._lost(call, f"{self.url} closed the call's stream without an answer")
        return self._from_message(call, message)

    def _start_cancel(self, call: RemoteCall) -> None:
        assert self._tg is not None
        self._tg.start_soon(self._send_cancel, call, call._reading)

    async def _send_cancel(self, call: RemoteCall, reading: anyio.CancelScope | None) -> None:
        """Send ``notifications/cancelled`` for the call. A toolpool face that honours it
        (header ``toolpool-cancel: accepted``) cancels the call with cause ``user`` and
        answers its request once the call settled: that answer is awaited. Otherwise
        (another server; another node behind a load balancer; a call not there yet) the
        call's response stream is closed, the 2026-07-28 wire's cancel."""
        import httpx2

        body = self._body(
            None,
            "notifications/cancelled",
            {"requestId": call._wire_id, "reason": call._cancel_reason},
        )
        try:
            answer = await self._http.post(
                self.url, content=body, headers=self._headers("notifications/cancelled", None)
            )
        except httpx2.TransportError:
            pass  # (closing the stream below is the cancel that counts)
        else:
            if answer.status_code == 202 and answer.headers.get(_CANCEL_HEADER) == "accepted":
                return
        if reading is not None:
            reading.cancel()

    def _from_message(self, call: RemoteCall, message: Mapping[str, Any]) -> Result:
        if "error" in message:
            error = message["error"]
            text = str(error.get("message", error)) if isinstance(error, Mapping) else str(error)
            if "draining" in text.lower():
                raise ServerUnavailable(f"{self.url}: {text}")
            if "unknown tool" in text.lower():
                raise UnknownToolError(text)
            raise RemoteError(f"{self.url}: {text}")
        result = message.get("result")
        if not isinstance(result, Mapping):
            raise RemoteError(f"{self.url}: an answer without a result")
        facts = result.get("structuredContent")
        facts = facts if isinstance(facts, Mapping) else {}
        texts = [c.get("text", "") for c in result.get("content", []) if isinstance(c, Mapping)]
        try:
            outcome = Outcome(facts.get("outcome", "error" if result.get("isError") else "ok"))
        except ValueError:
            raise RemoteError(f"{self.url}: unknown outcome {facts.get('outcome')!r}") from None
        if outcome is Outcome.ABORTED_BEFORE_DISPATCH and "draining" in " ".join(texts).lower():
            raise ServerUnavailable(f"{self.url}: {' '.join(texts)}")
        started = facts.get("body_started")
        try:
            rung = Rung(facts.get("rung") or "none")
        except ValueError:
            rung = Rung.NONE
        cause = None
        if isinstance(facts.get("cause"), str):
            try:
                cause = validate_cause({"kind": facts["cause"]}, allow_runtime=True)
            except ValueError:
                cause = None  # (a kind this client does not know: not invented)
        error = None if outcome is Outcome.OK else (facts.get("error") or " ".join(texts) or None)
        value = facts.get("value") if outcome is Outcome.OK else None
        if outcome is Outcome.OK and "value" not in facts and texts:
            value = texts[0]
        return self._settle(
            call,
            outcome,
            value=value,
            error=error,
            error_name=facts.get("error_name"),
            body_started=started if isinstance(started, bool) else None,
            rung=rung,
            cause=cause,
        )

    def _lost(self, call: RemoteCall, why: str) -> Result:
        return self._settle(
            call,
            Outcome.WORKER_LOST,
            error=f"Error: tool call lost: {why}",
            error_name=SERVER_LOST,
            body_started=True if call.body_started else None,
        )

    def _unconfirmed(self, call: RemoteCall) -> Result:
        return self._settle(
            call,
            Outcome.ERROR,
            error="Error: the call was cancelled; the server did not say how it ended",
            error_name="CancelUnconfirmed",
            body_started=True if call.body_started else None,
        )

    @staticmethod
    def _settle(call: RemoteCall, outcome: Outcome, **fields: Any) -> Result:
        now = time.monotonic()
        return Result(
            call_id=call.id,
            tool=call.tool,
            outcome=outcome,
            timeline=Timeline(submitted=call._submitted, dispatched=call._submitted, settled=now),
            **fields,
        )


def connect(
    url: str,
    *,
    token: str | None = None,
    max_connections: int = 100,
    connect_timeout: float = 10.0,
) -> Client:
    """A :class:`Client` of the toolpool service at ``url`` (``http://host:port/mcp``):
    ``async with toolpool.connect(url, token=...) as client: await client.call(...)``."""
    return Client(
        url,
        token=token,
        max_connections=max_connections,
        connect_timeout=connect_timeout,
    )


def _with_index(result: Result, index: int) -> Result:
    import dataclasses

    return dataclasses.replace(result, index=index)


def _result_or_raise(message: Mapping[str, Any], url: str) -> Any:
    if "error" in message:
        raise RemoteError(f"{url}: {message['error']}")
    return message.get("result", {})


async def _answer(
    response: Any, request_id: int | str, on_message: Any
) -> Mapping[str, Any] | None:
    """The JSON-RPC answer to ``request_id`` in ``response`` (JSON, or an event stream whose
    other messages go to ``on_message``); None if the stream ended without one."""
    kind = response.headers.get("content-type", "").split(";")[0].strip()
    if kind == "application/json":
        data = await response.aread()
        if not data:
            return None
        message = json.loads(data)
        return message if isinstance(message, Mapping) else None
    if kind != "text/event-stream":
        return None
    data_lines: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data_lines.append(line[5:].lstrip())
            continue
        if line == "" and data_lines:
            try:
                message = json.loads("\n".join(data_lines))
            except ValueError:
                message = None
            data_lines = []
            if not isinstance(message, Mapping):
                continue
            if message.get("id") == request_id and ("result" in message or "error" in message):
                return message
            on_message(message)
    return None
