"""The Open Inference Protocol's HTTP/REST routes, as a Starlette application.

``build_app(settings)`` is the ASGI application ``conveyor gateway`` serves; its
lifespan opens the ``Gateway`` (Kafka and Redis connections) and closes it. Every
route but the health probes asks for the bearer token when one is set. Every error
is ``{"error": <sentence>, "code": <code>}`` with the protocol's status
(docs/http.md has the table). Requests are counted by route and status and timed by
route on ``/metrics``.

The routes of OpenAI's API (``/v1/...``, for generation models) are
``producers.gateway.openai_routes``, over the same ``Gateway``, their errors in
OpenAI's shape.
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib.metadata import version as installed_version
from typing import Any

import orjson
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.install import DISTRIBUTION
from producers.gateway.oip import (
    HEADER_LENGTH,
    InferCall,
    ProtocolError,
    encode_infer,
    model_metadata,
    parse_infer,
    result_outputs,
    wants_classes,
)
from producers.gateway.openai_routes import OpenAIRoutes, openai_refusal
from producers.gateway.refusals import Refused, T, queued, result_refusal
from producers.gateway.service import Call, Gateway
from producers.gateway.settings import GatewaySettings
from producers.payload import sniff_content_type
from schemas import ContentType, ErrorCode, Status, is_valid_request_id
from schemas.description import DESCRIPTION_TTL_S, ModelDescription

Endpoint = Callable[[Request], Awaitable[Response]]
Render = Callable[[Refused], Response]

REQUEST_ID_HEADER = "x-request-id"
"""The idempotency key of a call, when the body has no ``id``."""
TIMEOUT_HEADER = "x-request-timeout"
"""The caller's timeout in seconds, when the body has no ``parameters.timeout``."""
_JSON = "application/json"


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "conveyor_gateway_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "conveyor_gateway_request_seconds",
            "Time from a request's arrival to its answer, by route",
            ["route"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )


def build_app(settings: GatewaySettings) -> Starlette:
    """The gateway's ASGI application for ``settings``."""
    routes = _Routes(settings)
    openai = OpenAIRoutes(settings)

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with Gateway(settings) as gateway:
            routes.gateway = openai.gateway = gateway
            yield

    infer_limit = settings.gateway_max_batch * (settings.limits.max_payload_bytes + 4) + 65_536
    table: list[tuple[str, str, Endpoint, bool, Render]] = [
        # (path, method, endpoint, needs the token, how its errors are answered)
        ("/v2/health/live", "GET", routes.live, False, _refusal),
        ("/v2/health/ready", "GET", routes.ready, False, _refusal),
        ("/v2", "GET", routes.server_metadata, True, _refusal),
        ("/v2/models/{name}", "GET", routes.metadata, True, _refusal),
        ("/v2/models/{name}/versions/{version}", "GET", routes.metadata, True, _refusal),
        ("/v2/models/{name}/ready", "GET", routes.model_ready, True, _refusal),
        ("/v2/models/{name}/versions/{version}/ready", "GET", routes.model_ready, True, _refusal),
        ("/v2/models/{name}/infer", "POST", routes.infer, True, _refusal),
        ("/v2/models/{name}/versions/{version}/infer", "POST", routes.infer, True, _refusal),
        ("/v2/results/{id}", "GET", routes.result, True, _refusal),
        ("/metrics", "GET", routes.metrics, True, _refusal),
        *(
            (path, method, endpoint, True, openai_refusal)
            for path, method, endpoint in openai.table()
        ),
    ]
    return Starlette(
        routes=[
            Route(
                path,
                routes.observed(path, endpoint, guarded, render),
                methods=[method],
                max_body_size=infer_limit if method == "POST" else None,
            )
            for path, method, endpoint, guarded, render in table
        ],
        lifespan=lifespan,
    )


class _Routes:
    """The endpoints, over the ``Gateway`` the lifespan opened."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.gateway: Gateway | None = None
        self._metrics = _Metrics()
        token = settings.gateway_token
        self._expected = None if token is None else f"Bearer {token.get_secret_value()}".encode()

    def observed(self, route: str, endpoint: Endpoint, guarded: bool, render: Render) -> Endpoint:
        """``endpoint`` behind the token check, its errors answered (``render``), counted
        and timed."""
        metrics = self._metrics

        async def run(request: Request) -> Response:
            started = time.perf_counter()
            try:
                if guarded:
                    self._check_token(request)
                response = await endpoint(request)
            except Refused as exc:
                response = render(exc)
            metrics.requests.labels(route, str(response.status_code)).inc()
            metrics.latency.labels(route).observe(time.perf_counter() - started)
            return response

        return run

    @property
    def _gateway(self) -> Gateway:
        if self.gateway is None:
            raise Refused(503, "unavailable", "the gateway is starting")
        return self.gateway

    def _check_token(self, request: Request) -> None:
        if self._expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, self._expected):
            raise Refused(
                401,
                "unauthorized",
                "this gateway needs a bearer token: send Authorization: Bearer <token>",
                {"WWW-Authenticate": "Bearer"},
            )

    async def live(self, _request: Request) -> Response:
        return _json({"live": True})

    async def ready(self, _request: Request) -> Response:
        checks = await self._gateway.checks()
        ready = all(checks.values())
        return _json({"ready": ready, "checks": checks}, 200 if ready else 503)

    async def server_metadata(self, _request: Request) -> Response:
        return _json(
            {
                "name": "conveyor",
                "version": installed_version(DISTRIBUTION),
                "extensions": ["binary_tensor_data", "classification"],
            }
        )

    async def metadata(self, request: Request) -> Response:
        name = request.path_params["name"]
        described = await self._described(name, request.path_params.get("version"))
        return _json(
            model_metadata(
                name,
                described.version,
                str(described.task),
                [str(c) for c in described.content_types],
                described.labels,
            )
        )

    async def model_ready(self, request: Request) -> Response:
        name = request.path_params["name"]
        try:
            await self._described(name, request.path_params.get("version"))
        except Refused as exc:
            if exc.status != 404:
                raise
            return _json({"name": name, "ready": False}, 400)
        return _json({"name": name, "ready": True})

    async def _described(self, name: str, version: str | None) -> ModelDescription:
        described: ModelDescription | None = await self._queue(self._gateway.describe(name))
        if described is None:
            raise Refused(
                404,
                "unknown_model",
                f"no worker has served model {name} within the last {DESCRIPTION_TTL_S} s: "
                f"start `conveyor worker --model-name {name} ...`",
            )
        if version is not None and version != described.version:
            raise Refused(
                404,
                "unknown_model",
                f"model {name} is served at version {described.version}, not {version}",
            )
        return described

    async def result(self, request: Request) -> Response:
        request_id = request.path_params["id"]
        if not is_valid_request_id(request_id):
            raise Refused(400, "bad_request", "a request id is 1–128 of [A-Za-z0-9._:-]")
        status = await self._queue(self._gateway.status(request_id))
        return _json(status.document(), 200 if status.result is not None else 202)

    async def metrics(self, _request: Request) -> Response:
        body = generate_latest(self._metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def infer(self, request: Request) -> Response:
        name = request.path_params["name"]
        version = request.path_params.get("version")
        if version is not None:
            await self._described(name, version)
        call = _parse(await request.body(), request, self.settings.gateway_max_batch)
        request_id = _request_id(call, request)
        ids = _ids(request_id, len(call.payloads))
        params = dict(call.params)
        top = wants_classes(call)
        if top is not None:
            params.setdefault("top_k", top)
        results = await self._queue(
            self._gateway.answer(
                Call(
                    model=name,
                    payloads=call.payloads,
                    ids=ids,
                    content_type=_content_type(call),
                    params=params,
                    timeout_s=_timeout_s(call, request),
                    traceparent=request.headers.get("traceparent"),
                )
            ),
            request_id,
        )
        failed = next((r for r in results if r.status is not Status.ok), None)
        if failed is not None:
            raise result_refusal(failed)
        version_served = results[0].model_version
        try:
            tensors = result_outputs(call.outputs, call.shape, [r.outputs for r in results])
        except ProtocolError as exc:
            raise Refused(400, "bad_request", str(exc)) from None
        body, header_length = encode_infer(name, version_served, request_id, tensors)
        headers = {"X-Request-Id": request_id}
        if header_length is None:
            return Response(body, media_type=_JSON, headers=headers)
        headers["Inference-Header-Content-Length"] = str(header_length)
        return Response(body, media_type="application/octet-stream", headers=headers)

    async def _queue(self, work: Awaitable[T], request_id: str | None = None) -> T:
        """``work``'s answer, with the queue's errors as protocol errors."""
        return await queued(work, self.settings.gateway_retry_after_s, request_id)


def _parse(body: bytes, request: Request, max_requests: int) -> InferCall:
    raw_length = request.headers.get(HEADER_LENGTH)
    try:
        header_length = None if raw_length is None else int(raw_length)
        return parse_infer(body, header_length, max_requests)
    except ValueError as exc:  # ProtocolError, or a header that is not a number
        raise Refused(400, ErrorCode.bad_request, str(exc)) from None


def _request_id(call: InferCall, request: Request) -> str:
    request_id = call.id or request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
    if not is_valid_request_id(request_id):
        raise Refused(
            400,
            ErrorCode.bad_request,
            "the request id (the body's id, or X-Request-Id) must be 1–128 characters of "
            "[A-Za-z0-9._:-]",
        )
    return request_id


def _ids(request_id: str, count: int) -> list[str]:
    """One request id per payload: the call's id for one, ``<id>.<n>`` for several."""
    if count == 1:
        return [request_id]
    ids = [f"{request_id}.{n}" for n in range(count)]
    if not is_valid_request_id(ids[-1]):
        raise Refused(
            400,
            ErrorCode.bad_request,
            f"request id {request_id} is too long for {count} requests: each is <id>.<n>, "
            "at most 128 characters",
        )
    return ids


def _content_type(call: InferCall) -> ContentType | str | None:
    """Every payload's media type: the input's ``parameters.content_type``; text for JSON
    strings, and for binary elements that are UTF-8 and no image or array (tritonclient
    sends text as binary BYTES, with no media type); None: each one's magic bytes say."""
    if call.content_type is not None:
        return call.content_type
    if call.text or all(_is_text(p) for p in call.payloads):
        return ContentType.TEXT
    return None


def _is_text(payload: bytes) -> bool:
    if sniff_content_type(payload) is not None:
        return False
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _timeout_s(call: InferCall, request: Request) -> float | None:
    if call.timeout_us is not None:
        return call.timeout_us / 1e6
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise Refused(400, ErrorCode.bad_request, f"{TIMEOUT_HEADER} must be seconds > 0")
    return value


def _refusal(exc: Refused) -> Response:
    body = {"error": exc.message, "code": str(exc.code), **exc.extra}
    return _json(body, exc.status, exc.headers)


def _json(document: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(document), status, headers, media_type=_JSON)
