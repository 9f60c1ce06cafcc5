"""The client SDK: submit requests to a model, read and wait for their results.

``AsyncClient`` holds the logic: ``RequestSender`` (Kafka) sends, ``ResultReader``
(Redis; ``ClusterResultReader`` with ``redis_cluster``) reads and waits.
``Client`` offers the same methods to synchronous code by running an
``AsyncClient`` on an event loop in a private thread (``producers.bridge``).

    with Client(bootstrap="127.0.0.1:9092", redis_url="redis://127.0.0.1:6379/0") as client:
        request_id = client.submit(Path("cat.jpg"), model="resnet50")
        print(client.wait(request_id, timeout=10).outputs)

Both take their settings as keywords (any field of ``ClientSettings``; the rest
from the CONVEYOR_* variables) or as one ``ClientSettings``.
"""

from __future__ import annotations

from collections.abc import (
    AsyncGenerator,
    Iterable,
    Mapping,
    Sequence,
)
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar, Unpack

from producers.bridge import LoopThread, SyncTwin, blocking, blocking_iter
from producers.claims import Uploader
from producers.cluster_results import ClusterResultReader
from producers.errors import InvalidInput
from producers.payload import load_payload
from producers.results import RequestStatus, ResultReader
from producers.sender import RequestSender
from producers.settings import ClientOptions, ClientSettings, settings_from
from producers.token_stream import StreamEvent, stream_events
from producers.tracing import submit_span
from schemas import ContentType, OutgoingRecord, Result, encode_request, new_request_id, topics_for

T = TypeVar("T")
Payload = bytes | Path
"""Payload bytes, or the path of a file to send."""
Deadline = datetime | timedelta
"""When the answer stops being useful: a timezone-aware time, or a time from now."""


class AsyncClient:
    """Submit requests and wait for results from asyncio code.

    Connections open on first use and close with ``close()`` or at the end of
    ``async with``. Kafka is needed only to submit, Redis only to read.
    """

    def __init__(
        self,
        settings: ClientSettings | None = None,
        /,
        *,
        bootstrap: str | None = None,
        **options: Unpack[ClientOptions],
    ) -> None:
        """Where to connect: ``AsyncClient(bootstrap="kafka:9092", redis_url="redis://cache:6379/0")``
        (``bootstrap`` is ``kafka_bootstrap``; any other ``ClientSettings`` field as a keyword,
        secrets as plain strings), or ``AsyncClient(ClientSettings(...))``. What is not
        given comes from the CONVEYOR_* variables, then the defaults.

        Raises ``TypeError`` naming the valid keywords for an unknown one, and pydantic's
        ``ValidationError`` (a ``ValueError``) naming the field for a bad value.
        """
        self.settings = settings_from("AsyncClient", settings, bootstrap, options)
        self._sender = RequestSender(self.settings)
        self._reader: ResultReader | ClusterResultReader = (
            ClusterResultReader(self.settings)
            if self.settings.redis_cluster
            else ResultReader(self.settings)
        )
        self._uploader = Uploader(self.settings)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Deliver buffered requests and give back every connection and subscription."""
        try:
            await self._sender.close()
        finally:
            try:
                await self._uploader.close()
            finally:
                await self._reader.close()

    async def submit(
        self,
        payload: Payload,
        *,
        model: str,
        params: Mapping[str, Any] | None = None,
        deadline: Deadline | None = None,
        request_id: str | None = None,
        reply_to: str | None = None,
        content_type: ContentType | str | None = None,
        lane: str | None = None,
    ) -> str:
        """Send one request to ``model``; returns its request id once the broker has it.

        ``content_type`` defaults to what the payload's magic bytes say (JPEG,
        PNG, WebP, npy). A payload larger than ``settings.dataref_threshold_bytes``
        is stored first (Redis or S3, ``settings.dataref_store``) and sent by
        reference (``ce_dataref``). ``lane`` sends it to the model's priority lane of
        that name (topic ``<prefix>.<model>.requests.<lane>``), served before the plain
        request topic by workers started with ``--lanes``. Raises ``InvalidInput`` or
        ``schemas.ContractError`` for input a worker would refuse, ``UnknownModel``
        when the model (or lane) has no request topic, and ``ServiceUnavailable`` when
        Kafka cannot be reached; in every case nothing was sent.
        """
        ids = await self.submit_many(
            [payload],
            model=model,
            params=params,
            deadline=deadline,
            request_ids=None if request_id is None else [request_id],
            reply_to=reply_to,
            content_type=content_type,
            lane=lane,
        )
        return ids[0]

    async def submit_many(
        self,
        payloads: Iterable[Payload],
        *,
        model: str,
        params: Mapping[str, Any] | None = None,
        deadline: Deadline | None = None,
        request_ids: Sequence[str] | None = None,
        reply_to: str | None = None,
        content_type: ContentType | str | None = None,
        lane: str | None = None,
    ) -> list[str]:
        """Send one request per payload, batched; returns their ids in payload order.

        Every payload is read and checked before the first one is sent, so bad
        input sends nothing. Options apply to every request; ``request_ids``,
        when given, has one id per payload.

        With OpenTelemetry set up by the application, the call is one ``submit`` span
        whose context every request carries as its ``traceparent`` (``producers.tracing``).
        """
        topic = _request_topic(model, lane, self.settings)
        with submit_span(topic) as span:
            ids, records, stored = self._encode_all(
                list(payloads),
                params=params,
                deadline=_absolute(deadline),
                request_ids=request_ids,
                reply_to=reply_to,
                content_type=content_type,
                traceparent=span.traceparent,
            )
            span.sent(ids)
            await self._uploader.store(stored)
            if records and self.settings.track_status:
                # Before sending: an id recorded and then not sent (a failed send) reads as
                # queued, but one sent is never called unknown.
                sent_ms = int(datetime.now(UTC).timestamp() * 1000)
                await self._reader.mark_sent(ids, sent_ms, self.settings.status_ttl_s)
            if records:
                await self._sender.send(model, topic, records)
        return ids

    async def result(self, request_id: str) -> Result | None:
        """The result of ``request_id`` now, or None while it is pending (one Redis read)."""
        return await self._reader.get(request_id)

    async def status(self, request_id: str) -> RequestStatus:
        """Where ``request_id`` stands now: ``queued``, ``running`` (when workers track
        status), ``done`` (with its result) or, when clients track status
        (``settings.track_status``), ``unknown``: no request with that id is known."""
        return await self._reader.status(request_id)

    async def cancel(self, request_id: str) -> RequestStatus:
        """Cancel ``request_id``: a worker that checks cancellations answers it
        ``cancelled`` instead of running it, unless its batch has started.

        Returns where the request stood when the cancellation was recorded: ``done``
        means it changes nothing (the first result stays), ``running`` that it is
        most likely too late. The cancellation is kept ``settings.cancel_ttl_s``.
        """
        return await self._reader.cancel(request_id, self.settings.cancel_ttl_s)

    # A timeout parameter rather than asyncio.timeout() around the call: the sync
    # Client shares it, and expiry raises ResultTimeout naming the pending ids.
    async def wait(self, request_id: str, timeout: float = 30.0) -> Result:  # noqa: ASYNC109
        """Wait up to ``timeout`` seconds for the result of ``request_id``.

        Raises ``ResultTimeout`` (naming the id) when none arrives in time.
        """
        results = self._reader.wait_many([request_id], timeout)
        try:
            return await anext(results)
        finally:
            await results.aclose()

    def wait_many(
        self, request_ids: Iterable[str], timeout: float = 30.0
    ) -> AsyncGenerator[Result, None]:
        """Yield the results of ``request_ids`` as they complete, within ``timeout`` s overall.

        Raises ``ResultTimeout`` naming the ids still pending when time is up.
        To stop early, close it: ``async with contextlib.aclosing(client.wait_many(ids)) as it``.
        """
        return self._reader.wait_many(request_ids, timeout)

    def stream(self, request_id: str, timeout: float = 120.0) -> AsyncGenerator[StreamEvent, None]:
        """Yield the events of ``request_id``'s generation as they come (a generation
        model's: ``start``, ``chunk`` with its ``text``, then ``end`` or ``error``).

        A ``start`` with ``restarted`` set means the request is generated again (its
        worker was killed): drop the text so far. Ends at the last event of the latest
        run, or at once when the request has its result and no stream. Raises
        ``ResultTimeout`` when it has not ended within ``timeout`` seconds; the result
        document (``wait``) is the answer."""
        reader = self._reader

        async def has_result() -> bool:
            return await reader.get(request_id) is not None

        return stream_events(request_id, reader.read_stream, has_result, timeout)

    def _encode_all(
        self,
        payloads: list[Payload],
        *,
        params: Mapping[str, Any] | None,
        deadline: datetime | None,
        request_ids: Sequence[str] | None,
        reply_to: str | None,
        content_type: ContentType | str | None,
        traceparent: str | None,
    ) -> tuple[list[str], list[OutgoingRecord], list[tuple[str, bytes]]]:
        """Records for every payload, and the payloads to store first (by request id)."""
        if request_ids is not None and len(request_ids) != len(payloads):
            raise InvalidInput(
                f"request_ids has {len(request_ids)} ids for {len(payloads)} payloads; "
                "give one id per payload, or none"
            )
        ids = list(request_ids) if request_ids is not None else [new_request_id() for _ in payloads]
        limits = self.settings.limits
        uploader = self._uploader
        records = []
        stored: list[tuple[str, bytes]] = []
        for payload, request_id in zip(payloads, ids, strict=True):
            data, media_type = load_payload(payload, content_type, limits, uploader.max_bytes)
            dataref, dataexpires = None, None
            if uploader.wants(len(data)):
                dataref, dataexpires = uploader.reference(request_id)
                stored.append((request_id, data))
                data = b""
            records.append(
                encode_request(
                    data,
                    request_id=request_id,
                    content_type=media_type,
                    source=self.settings.source,
                    params=params,
                    deadline=deadline,
                    reply_to=reply_to,
                    traceparent=traceparent,
                    time=datetime.now(UTC),
                    dataref=dataref,
                    dataexpires=dataexpires,
                    limits=limits,
                )
            )
        return ids, records, stored


class Client(SyncTwin[AsyncClient]):
    """The synchronous twin of ``AsyncClient``: same methods, same errors, blocking calls.

    Runs an ``AsyncClient`` on an event loop in a private daemon thread, started
    here and stopped by ``close()`` (or the end of ``with``). Safe to call from
    several threads. Interrupting a call (Ctrl-C) cancels it on the loop, which
    gives back what it held.
    """

    def __init__(
        self,
        settings: ClientSettings | None = None,
        /,
        *,
        bootstrap: str | None = None,
        **options: Unpack[ClientOptions],
    ) -> None:
        """Where to connect, as for ``AsyncClient``: keywords
        (``Client(bootstrap="kafka:9092", redis_url="redis://cache:6379/0")``) or one
        ``ClientSettings``."""
        self.settings = settings_from("Client", settings, bootstrap, options)
        self._loop = LoopThread("conveyor-client")
        try:
            self._twin = self._loop.call(_make_async_client(self.settings))
        except BaseException:
            self._loop.close()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Deliver buffered requests, give back every connection, stop the loop thread."""
        if not self._loop.closed:
            self._loop.close(self._twin.close())

    submit = blocking(AsyncClient.submit)
    submit_many = blocking(AsyncClient.submit_many)
    result = blocking(AsyncClient.result)
    status = blocking(AsyncClient.status)
    cancel = blocking(AsyncClient.cancel)
    wait = blocking(AsyncClient.wait)
    stream = blocking_iter(
        AsyncClient.stream,
        doc="""Yield the events of ``request_id``'s generation as they come (``start``,
        ``chunk`` with its ``text``, then ``end`` or ``error``); a ``start`` with
        ``restarted`` set voids the text so far. Stopping early (``break``) ends it.
        """,
    )
    wait_many = blocking_iter(
        AsyncClient.wait_many,
        doc="""Yield the results of ``request_ids`` as they complete, within ``timeout`` s overall.

        Raises ``ResultTimeout`` naming the ids still pending when time is up.
        Stopping early (``break``) ends the wait.
        """,
    )


def _request_topic(model: str, lane: str | None, settings: ClientSettings) -> str:
    try:
        topics = topics_for(model, settings.topic_prefix)
        return topics.requests if lane is None else topics.lane(lane)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def _absolute(deadline: Deadline | None) -> datetime | None:
    if isinstance(deadline, timedelta):
        return datetime.now(UTC) + deadline
    return deadline


async def _make_async_client(settings: ClientSettings) -> AsyncClient:
    # Built on the loop thread, so everything it creates belongs to that loop.
    return AsyncClient(settings)
