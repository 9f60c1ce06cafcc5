"""OpenAI's API for generation models: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, beside the Open Inference Protocol's routes over the same
``Gateway``.

A call is one generation request (``producers.gateway.openai_requests`` maps the bodies,
``openai_answers`` the answers), sent
as every gateway call is: the request id (``X-Request-Id``, else a new one) is the
idempotency key, the model's lag decides back-pressure (429), ``X-Request-Timeout``
is the wait and the request's deadline (504 naming the id). ``stream: false`` waits
for the result document; ``stream: true`` answers with server-sent events relayed
from the request's Redis Stream, its first event awaited before the response starts,
so that a request refused before it is generated (a prompt too long, a tokenizer with
no chat template) is an HTTP error, not a stream. A caller that disconnects
mid-stream cancels its generation (a worker with ``--cancellation`` stops it within a
step). Errors are OpenAI's shape (``error_body``).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
import orjson
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from producers.errors import ClientError, ResultTimeout
from producers.gateway.openai_answers import (
    Chunks,
    Diverged,
    Resumed,
    completion_body,
    error_body,
    model_entry,
    sse,
)
from producers.gateway.openai_requests import (
    BadRequest,
    Generation,
    parse_body,
    parse_chat,
    parse_completion,
)
from producers.gateway.refusals import Refused, T, queue_refusal, queued, result_refusal
from producers.gateway.service import AnswerTimeout, Call, Gateway
from producers.gateway.settings import GatewaySettings
from producers.token_stream import StreamEvent
from schemas import ContentType, ErrorCode, Result, Status, is_valid_request_id
from schemas.description import Task

Endpoint = Callable[[Request], Awaitable[Response]]

_OPENAI_CODES = {"unknown_model": "model_not_found", "unauthorized": "invalid_api_key"}
"""Conveyor's codes that OpenAI has its own name for; the others stay Conveyor's."""
_CANCEL_S = 5.0  # how long a disconnected caller's cancellation may take to record


def openai_refusal(exc: Refused) -> Response:
    """A refusal in OpenAI's error shape."""
    code = _OPENAI_CODES.get(str(exc.code), str(exc.code))
    body = error_body(exc.status, code, exc.message, exc.extra.get("param"))
    return _json(body, exc.status, exc.headers)


class OpenAIRoutes:
    """The ``/v1`` endpoints, over the ``Gateway`` the lifespan opened."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.gateway: Gateway | None = None

    def table(self) -> list[tuple[str, str, Endpoint]]:
        """(path, method, endpoint) of every route."""
        return [
            ("/v1/models", "GET", self.models),
            ("/v1/models/{model}", "GET", self.model),
            ("/v1/completions", "POST", self.completions),
            ("/v1/chat/completions", "POST", self.chat),
        ]

    @property
    def _gateway(self) -> Gateway:
        if self.gateway is None:
            raise Refused(503, "unavailable", "the gateway is starting")
        return self.gateway

    async def models(self, _request: Request) -> Response:
        described = await self._queue(self._gateway.generation_models())
        data = [model_entry(d.name, d.published_ms // 1000) for d in described]
        return _json({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        described = await self._queue(self._gateway.describe(name))
        if described is None or described.task != Task.text_generation:
            raise _not_generation(name, None if described is None else str(described.task))
        return _json(model_entry(name, described.published_ms // 1000))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    async def _generate(
        self, request: Request, parse: Callable[[Mapping[str, Any]], Generation]
    ) -> Response:
        try:
            generation = parse(parse_body(await request.body()))
        except BadRequest as exc:
            refused = Refused(400, ErrorCode.bad_request, str(exc))
            refused.extra = {"param": exc.param}
            raise refused from None
        gateway = self._gateway
        described = await self._queue(gateway.describe(generation.model))
        # No description: no worker serves it now; the topic decides (404 without one).
        if described is not None and described.task != Task.text_generation:
            raise _not_generation(generation.model, str(described.task))
        request_id = _request_id(request)
        call = Call(
            model=generation.model,
            payloads=[generation.payload],
            ids=[request_id],
            content_type=ContentType.JSON,
            params=generation.params,
            timeout_s=_timeout_s(request),
            traceparent=request.headers.get("traceparent"),
        )
        created = int(time.time())
        if generation.stream:
            return await self._stream(generation, call, created)
        (result,) = await self._queue(gateway.answer(call), request_id)
        if result.status is not Status.ok:
            raise result_refusal(result)
        body = completion_body(
            generation.kind, request_id, generation.model, created, result.outputs
        )
        return _json(body, headers={"X-Request-Id": request_id})

    async def _stream(self, generation: Generation, call: Call, created: int) -> Response:
        gateway = self._gateway
        request_id = call.ids[0]
        chunks = Chunks(
            generation.kind, request_id, generation.model, created, generation.include_usage
        )
        found = await self._queue(gateway.send(call), request_id)
        wait_s = gateway.wait_s(call.timeout_s)
        if request_id in found:  # answered before (a retry): the whole text in one chunk
            return _event_stream(_replay(chunks, _ok(found[request_id])), request_id)
        events = gateway.stream(request_id, wait_s)
        try:
            await self._queue(_first_event(events, request_id, wait_s), request_id)
        except StopAsyncIteration:  # answered without a generation: refused, most often
            result = await self._queue(gateway.result(request_id, wait_s), request_id)
            return _event_stream(_replay(chunks, _ok(result)), request_id)
        except BaseException:
            await events.aclose()
            raise
        relay = _Relay(gateway, request_id, wait_s, chunks)
        return _event_stream(relay.events(events), request_id)

    async def _queue(self, work: Awaitable[T], request_id: str | None = None) -> T:
        """``work``'s answer, with the queue's errors as refusals."""
        return await queued(work, self.settings.gateway_retry_after_s, request_id)


class _Relay:
    """One request's stream relayed as OpenAI chunks, and cancelled when its caller goes."""

    def __init__(self, gateway: Gateway, request_id: str, wait_s: float, chunks: Chunks) -> None:
        self._gateway = gateway
        self._id = request_id
        self._wait_s = wait_s
        self._chunks = chunks

    async def events(self, stream: AsyncGenerator[StreamEvent, None]) -> AsyncIterator[bytes]:
        """The server-sent events, from the stream after its first ``start``."""
        ended = False  # the stream ended on its own: nothing to cancel
        try:
            first = self._chunks.first()
            if first is not None:
                yield sse(first)
            resumed = Resumed()
            async for event in stream:
                if event.type == "start":  # generated again: hold what was already sent
                    resumed.restart()
                elif event.type == "chunk" and (new := resumed.add(event.text)):
                    yield sse(self._chunks.text(new))
            ended = True
            result = await self._gateway.result(self._id, self._wait_s)
            if result.status is not Status.ok:
                yield _error_event(result_refusal(result))
            else:
                yield sse(self._chunks.finish(result.outputs.get("finish_reason")))
                usage = self._chunks.usage(result.outputs)
                if usage is not None:
                    yield sse(usage)
        except Diverged:
            ended = True
            yield _error_event(
                Refused(
                    500,
                    "restarted",
                    f"the generation of {self._id} was restarted on another worker and its "
                    "new text differs from the text streamed so far: read the answer at "
                    f"/v2/results/{self._id}",
                )
            )
        except (ResultTimeout, AnswerTimeout, ClientError) as exc:
            ended = True  # the request goes on: it is answered, and readable later
            if isinstance(exc, ResultTimeout):
                exc = AnswerTimeout([self._id], self._wait_s)
            refused = queue_refusal(exc, 1, self._id) or Refused(500, "internal", str(exc))
            yield _error_event(refused)
        finally:
            with anyio.CancelScope(shield=True):
                if not ended:  # the caller went away (or the relay failed): stop the generation
                    await self._cancel()
                await stream.aclose()
        yield sse(None)

    async def _cancel(self) -> None:
        with anyio.move_on_after(_CANCEL_S), contextlib.suppress(ClientError, RedisError, OSError):
            await self._gateway.cancel(self._id)


async def _first_event(
    events: AsyncGenerator[StreamEvent, None], request_id: str, wait_s: float
) -> StreamEvent:
    """The stream's first event (its ``start``); ``StopAsyncIteration`` when the request
    has its result and no stream."""
    try:
        return await anext(events)
    except ResultTimeout:
        raise AnswerTimeout([request_id], wait_s) from None


def _ok(result: Result) -> Result:
    if result.status is not Status.ok:
        raise result_refusal(result)
    return result


async def _replay(chunks: Chunks, result: Result) -> AsyncIterator[bytes]:
    """A result's whole text as one stream: a request answered before this call."""
    outputs = result.outputs
    for chunk in (chunks.first(), chunks.text(str(outputs.get("text", "")))):
        if chunk is not None:
            yield sse(chunk)
    yield sse(chunks.finish(outputs.get("finish_reason")))
    usage = chunks.usage(outputs)
    if usage is not None:
        yield sse(usage)
    yield sse(None)


def _error_event(refused: Refused) -> bytes:
    """An error after the stream began (status 200 is sent): an event with the error."""
    code = _OPENAI_CODES.get(str(refused.code), str(refused.code))
    return sse(error_body(refused.status, code, refused.message))


def _event_stream(body: AsyncIterator[bytes], request_id: str) -> StreamingResponse:
    headers = {"X-Request-Id": request_id, "Cache-Control": "no-cache"}
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


def _not_generation(name: str, task: str | None) -> Refused:
    if task is None:
        what = f"no worker has served model {name} lately"
    else:
        what = (
            f"model {name} is a {task} model, not a generation model (use /v2/models/{name}/infer)"
        )
    refused = Refused(404, "unknown_model", f"{what}: GET /v1/models lists the generation models")
    refused.extra = {"param": "model"}
    return refused


def _request_id(request: Request) -> str:
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    if not is_valid_request_id(request_id):
        raise Refused(
            400, ErrorCode.bad_request, "X-Request-Id must be 1–128 characters of [A-Za-z0-9._:-]"
        )
    return request_id


def _timeout_s(request: Request) -> float | None:
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise Refused(400, ErrorCode.bad_request, "X-Request-Timeout must be seconds > 0")
    return value


def _json(document: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(document), status, headers, media_type="application/json")
