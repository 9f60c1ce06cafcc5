"""The client commands of ``conveyor``: submit, result, status, wait, cancel and topics create
(``results rebuild`` is ``producers.rebuild_command``'s).

Each command parses its input completely (files, ``--params``, settings)
before it connects to anything, prints results as JSON lines on stdout and
everything meant for people on stderr. Exit status: 0 every result ``ok`` (or
submitted), 1 some result is not ``ok``, 2 bad input, 3 no result in time,
4 Kafka or Redis unreachable, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine, Sequence
from contextlib import aclosing
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
from pydantic import SecretStr, ValidationError

from producers.admin import create_model_topics
from producers.client import AsyncClient
from producers.errors import ClientError, InvalidInput, ResultTimeout, ServiceUnavailable
from producers.progress import ProgressBar
from producers.results import RequestStatus
from producers.settings import ClientSettings
from schemas import ContentType, ContractError, Result, Status, topics_for

EXIT_OK = 0
EXIT_NOT_OK = 1
EXIT_BAD_INPUT = 2
EXIT_NO_RESULT = 3
EXIT_UNAVAILABLE = 4
EXIT_INTERRUPTED = 130

Command = Callable[[argparse.Namespace, ClientSettings], Coroutine[Any, Any, int]]


def connection_options(parser: argparse.ArgumentParser, dest_prefix: str = "") -> None:
    """``--kafka-bootstrap`` and ``--redis-url``, stored as ``<dest_prefix>kafka_bootstrap``..."""
    parser.add_argument(
        "--kafka-bootstrap",
        dest=f"{dest_prefix}kafka_bootstrap",
        metavar="HOST:PORT",
        help="Kafka bootstrap servers [env CONVEYOR_KAFKA_BOOTSTRAP, default 127.0.0.1:9092]",
    )
    parser.add_argument(
        "--redis-url",
        dest=f"{dest_prefix}redis_url",
        metavar="URL",
        help="Redis URL [env CONVEYOR_REDIS_URL, default redis://127.0.0.1:6379/0]",
    )


CONNECTION_OPTIONS: Sequence[str] = ("kafka_bootstrap", "redis_url")
"""Dest names of the connection options, shared by every subcommand that connects."""


def add_client_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    connection: argparse.ArgumentParser,
) -> None:
    """Add submit, result, status, wait, cancel and topics to ``commands``; ``connection`` holds the
    ``--kafka-bootstrap`` and ``--redis-url`` options each of them accepts."""
    submit = commands.add_parser(
        "submit",
        parents=[connection],
        help="send files as requests to a model; print one JSON line per file",
    )
    submit.add_argument("files", nargs="+", type=Path, metavar="FILE")
    submit.add_argument("--model", required=True, help="model name (topic conveyor.MODEL.requests)")
    submit.add_argument(
        "--lane", help="priority lane: send to conveyor.MODEL.requests.LANE (default: none)"
    )
    submit.add_argument("--wait", action="store_true", help="wait for and print the results")
    submit.add_argument(
        "--stream",
        action="store_true",
        help="a generation model's text on stdout as it is made, file after file (a restart "
        "is said on stderr); the exit status is the result's",
    )
    submit.add_argument("--timeout", type=float, default=30.0, help="seconds --wait waits")
    submit.add_argument("--params", help="JSON object of model parameters, e.g. '{\"top_k\": 3}'")
    submit.add_argument(
        "--content-type",
        choices=[c.value for c in ContentType],
        help="media type of every file (default: from each file's first bytes)",
    )
    submit.add_argument("--deadline", type=float, help="seconds after which answers are useless")
    submit.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr while waiting (default: on a terminal, for several files)",
    )
    submit.set_defaults(handler=runner(_submit))

    result = commands.add_parser(
        "result", parents=[connection], help="print a request's result now, if it has one"
    )
    result.add_argument("request_id", metavar="ID")
    result.set_defaults(handler=runner(_result))

    status = commands.add_parser(
        "status",
        parents=[connection],
        help="print where a request stands: queued, running or done (with its result)",
    )
    status.add_argument("request_id", metavar="ID")
    status.set_defaults(handler=runner(_status))

    cancel = commands.add_parser(
        "cancel",
        parents=[connection],
        help="cancel requests not started yet; print where each stood",
        description="Set each request's cancellation key. Workers started with "
        "--cancellation answer a request cancelled before its batch runs with error code "
        "'cancelled', without running it; a request that already has a result keeps it.",
    )
    cancel.add_argument("request_ids", nargs="+", metavar="ID")
    cancel.set_defaults(handler=runner(_cancel))

    wait = commands.add_parser(
        "wait", parents=[connection], help="wait for a request's result and print it"
    )
    wait.add_argument("request_id", metavar="ID")
    wait.add_argument("--timeout", type=float, default=30.0, help="seconds to wait")
    wait.set_defaults(handler=runner(_wait))

    topics = commands.add_parser("topics", help="manage a model's Kafka topics")
    topic_commands = topics.add_subparsers(dest="topics_command", required=True)
    create = topic_commands.add_parser(
        "create",
        parents=[connection],
        help="create a model's request, result and dead-letter topics",
        description="Create conveyor.MODEL.requests, .results and .dlq (and "
        "conveyor.MODEL.requests.LANE per priority lane). Give the request topics at least "
        "as many partitions as the most workers you plan to run for the model: a worker "
        "beyond the partition count gets no work.",
    )
    create.add_argument("--model", required=True, help="model name")
    create.add_argument(
        "--lanes",
        default="",
        help="comma-separated priority lanes, e.g. high: a request topic for each "
        "(the worker's --lanes names them too)",
    )
    create.add_argument(
        "--partitions", type=int, required=True, help=">= the most workers planned for the model"
    )
    create.add_argument("--replication-factor", type=int, default=1)
    create.add_argument(
        "--shadow",
        action="store_true",
        help="also conveyor.MODEL.shadow-results, where shadow workers (conveyor worker "
        "--shadow) write",
    )
    create.set_defaults(handler=runner(_topics_create))


def runner(command: Command) -> Callable[[argparse.Namespace], int]:
    """Settings from flags and environment, then the command, with errors as exit codes."""

    def run(args: argparse.Namespace) -> int:
        name = f"conveyor {args.command}"
        try:
            settings = _settings(args)
        except ValidationError as exc:
            return _fail(name, _describe(exc), EXIT_BAD_INPUT)
        # The client's own errors say what failed; aiokafka's log lines would repeat it.
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
        try:
            return asyncio.run(command(args, settings))
        except (InvalidInput, ContractError) as exc:
            return _fail(name, str(exc), EXIT_BAD_INPUT)
        except ResultTimeout as exc:
            return _fail(name, str(exc), EXIT_NO_RESULT)
        except ServiceUnavailable as exc:
            return _fail(name, str(exc), EXIT_UNAVAILABLE)
        except ClientError as exc:  # an unknown model, a broker that refused
            return _fail(name, str(exc), EXIT_BAD_INPUT)
        except KeyboardInterrupt:
            return _fail(name, "interrupted", EXIT_INTERRUPTED)

    return run


async def _submit(args: argparse.Namespace, settings: ClientSettings) -> int:
    params = _params(args.params)
    files: list[Path] = args.files
    deadline = None if args.deadline is None else timedelta(seconds=args.deadline)
    async with AsyncClient(settings) as client:
        ids = await client.submit_many(
            files,
            model=args.model,
            params=params,
            deadline=deadline,
            content_type=args.content_type,
            lane=args.lane,
        )
        if args.stream:
            return await _stream(client, ids, args.timeout)
        if not args.wait:
            for path, request_id in zip(files, ids, strict=True):
                _print({"file": str(path), "id": request_id})
            return EXIT_OK
        show = args.progress if args.progress is not None else sys.stderr.isatty() and len(ids) > 1
        progress = ProgressBar(len(ids), "results", sys.stderr) if show else None
        file_of = dict(zip(ids, files, strict=True))
        status = EXIT_OK
        try:
            async with aclosing(client.wait_many(ids, args.timeout)) as results:
                async for result in results:
                    _print({"file": str(file_of.pop(result.id)), **_document(result)})
                    status = max(status, _exit_status(result))
                    if progress is not None:
                        progress.advance()
        except ResultTimeout:
            # The ids still pending, so they can be waited for (or read) later.
            for request_id, path in file_of.items():
                _print({"file": str(path), "id": request_id, "status": "pending"})
            raise
        finally:
            if progress is not None:
                progress.close()
        return status


async def _stream(client: AsyncClient, ids: list[str], timeout_s: float) -> int:
    """Print each request's text as it comes, then wait for its result."""
    status = EXIT_OK
    for request_id in ids:
        async with aclosing(client.stream(request_id, timeout_s)) as events:
            async for event in events:
                if event.restarted:  # the text printed so far is void: say so
                    print(
                        f"\n[{request_id}: generated again, attempt {event.attempt}]",
                        file=sys.stderr,
                    )
                elif event.type == "chunk":
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                elif event.type == "error":
                    print(f"\n[{request_id}: {event.code}: {event.message}]", file=sys.stderr)
        sys.stdout.write("\n")
        result = await client.wait(request_id, timeout_s)
        if result.status is not Status.ok:
            sys.stderr.write(orjson.dumps(_document(result)).decode() + "\n")
        status = max(status, _exit_status(result))
    return status


async def _result(args: argparse.Namespace, settings: ClientSettings) -> int:
    async with AsyncClient(settings) as client:
        status = await client.status(args.request_id)
    result = status.result
    if result is None:
        return _fail(f"conveyor {args.command}", _no_result(status, None), EXIT_NO_RESULT)
    _print(_document(result))
    return _exit_status(result)


async def _status(args: argparse.Namespace, settings: ClientSettings) -> int:
    async with AsyncClient(settings) as client:
        status = await client.status(args.request_id)
    _print(status.document())
    if status.state == "unknown":
        print(f"conveyor {args.command}: {_no_result(status, None)}", file=sys.stderr)
    return EXIT_OK


async def _cancel(args: argparse.Namespace, settings: ClientSettings) -> int:
    ids: list[str] = args.request_ids
    async with AsyncClient(settings) as client:
        for request_id in ids:
            status = await client.cancel(request_id)
            _print({"id": request_id, "state_when_cancelled": status.state})
    return EXIT_OK


def _no_result(status: RequestStatus, waited_s: float | None) -> str:
    """Why ``status`` has no result, as plainly as Redis allows."""
    request_id = status.id
    within = f" within {waited_s:g} s" if waited_s is not None else " yet"
    if status.state == "unknown":
        return (
            f"no request with id {request_id} is known: no client recorded sending it, no "
            "worker started it and it has no result (clients track status, "
            "CONVEYOR_TRACK_STATUS); check the id, or it was sent longer ago than its "
            "records are kept"
        )
    if status.state == "running":
        return (
            f"no result for {request_id}{within}: running on worker {status.worker} since "
            f"{status.started_ms} (epoch ms), attempt {status.attempt}; "
            "`conveyor wait ID` waits for it"
        )
    if status.sent_ms is not None:
        return (
            f"no result for {request_id}{within}: sent at {status.sent_ms} (epoch ms) and "
            "not started by any worker yet (is a worker running for its model?); "
            "`conveyor wait ID` waits for it"
        )
    return (
        f"no result for {request_id}{within}, and no worker has started it: it may still be "
        "queued, or no request with this id was ever sent (or its result outlived its time "
        "in Redis). Clients do not track status here, so Redis cannot tell these apart; "
        "with CONVEYOR_TRACK_STATUS=true on clients it can"
    )


async def _wait(args: argparse.Namespace, settings: ClientSettings) -> int:
    async with AsyncClient(settings) as client:
        try:
            result = await client.wait(args.request_id, args.timeout)
        except ResultTimeout:
            status = await client.status(args.request_id)
            if status.result is None:
                message = _no_result(status, args.timeout)
                return _fail(f"conveyor {args.command}", message, EXIT_NO_RESULT)
            result = status.result  # it landed just after the wait gave up
    _print(_document(result))
    return _exit_status(result)


async def _topics_create(args: argparse.Namespace, settings: ClientSettings) -> int:
    lanes = [lane.strip() for lane in args.lanes.split(",") if lane.strip()]
    states = await create_model_topics(
        settings, args.model, args.partitions, args.replication_factor, lanes, shadow=args.shadow
    )
    topics = topics_for(args.model, settings.topic_prefix)  # checked by the call above
    request_topics = {topics.requests, *(topics.lane(lane) for lane in lanes)}
    needed = settings.limits.max_record_bytes
    status = EXIT_OK
    name = f"conveyor {args.command}"
    for state in states:
        verb = "created" if state.created else "exists "
        plural = "" if state.partitions == 1 else "s"
        size = "?" if state.max_message_bytes is None else state.max_message_bytes
        print(
            f"{verb} {state.name} ({state.partitions} partition{plural}, max.message.bytes {size})"
        )
        if state.name in request_topics and state.partitions < args.partitions:
            status = _fail(
                name,
                f"{state.name} already exists with {state.partitions} partitions, fewer than "
                f"the {args.partitions} asked for; add partitions with Kafka's tools "
                "(kafka-topics.sh --alter --partitions N) before running more workers",
                EXIT_NOT_OK,
            )
        if state.max_message_bytes is not None and state.max_message_bytes < needed:
            status = _fail(
                name,
                f"{state.name} already exists and takes records of at most "
                f"{state.max_message_bytes} bytes, less than the {needed} a request within "
                "the payload limit needs; raise it with kafka-configs.sh --alter --entity-type "
                f"topics --entity-name {state.name} --add-config max.message.bytes={needed}",
                EXIT_NOT_OK,
            )
    print(
        f"new topics take records of up to {needed} bytes (max.message.bytes): the largest "
        f"payload a request may carry ({settings.limits.max_payload_bytes} bytes, "
        "CONVEYOR_LIMITS__MAX_PAYLOAD_BYTES) plus its headers",
        file=sys.stderr,
    )
    print(
        f"partitions should be >= the largest number of workers planned for {args.model}: "
        "a worker beyond the partition count gets no work",
        file=sys.stderr,
    )
    return status


def _settings(args: argparse.Namespace) -> ClientSettings:
    given: dict[str, Any] = {}
    if args.kafka_bootstrap is not None:
        given["kafka_bootstrap"] = args.kafka_bootstrap
    if args.redis_url is not None:
        given["redis_url"] = SecretStr(args.redis_url)
    return ClientSettings(**given)


def _params(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        params = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"--params is not valid JSON ({exc}): {text!r}") from None
    if not isinstance(params, dict):
        raise InvalidInput(f'--params must be a JSON object like {{"top_k": 3}}, not {text!r}')
    return params


def _document(result: Result) -> dict[str, Any]:
    document: dict[str, Any] = result.model_dump(mode="json")
    return document


def _exit_status(result: Result) -> int:
    return EXIT_OK if result.status is Status.ok else EXIT_NOT_OK


def _print(document: dict[str, Any]) -> None:
    sys.stdout.write(orjson.dumps(document).decode() + "\n")
    sys.stdout.flush()


def _fail(name: str, message: str, status: int) -> int:
    print(f"{name}: {message}", file=sys.stderr)
    return status


def _describe(exc: ValidationError) -> str:
    lines = ["invalid client settings:"]
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"]) or "settings"
        lines.append(
            f"  {field} (--{field.replace('_', '-')} or CONVEYOR_{field.upper()}): {err['msg']}"
        )
    return "\n".join(lines)
