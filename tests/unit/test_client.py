"""The client SDK's pure parts: payload sniffing, input checks, errors, settings, CLI parsing.

Nothing here talks to Kafka or Redis; where a client is built, it points at a
closed port, so a check that ran after connecting would fail differently.
"""

from __future__ import annotations

import asyncio
import io
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from producers import (
    AsyncClient,
    Client,
    ClientOptions,
    ClientSettings,
    ConnectionsBusy,
    InvalidInput,
    RequestStatus,
    ResultTimeout,
    UnknownModel,
    sniff_content_type,
)
from producers.cli import _apply_global_options, build_parser, main
from producers.commands import _no_result
from producers.payload import load_payload
from producers.progress import ProgressBar
from producers.results import request_status
from producers.subscriber import Verb, _commands
from schemas import ContentType, ContractError, Limits
from workers.cli import settings_from_args

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 24
# Nothing listens on port 9 (discard): a client that tried to connect would fail there.
UNREACHABLE = ClientSettings(
    kafka_bootstrap="127.0.0.1:9", redis_url=SecretStr("redis://127.0.0.1:9/0")
)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"\xff\xd8\xff\xe0\0\x10JFIF", ContentType.JPEG),
        (PNG, ContentType.PNG),
        (b"RIFF\x24\0\0\0WEBPVP8 ", ContentType.WEBP),
        (b"\x93NUMPY\x01\0v\0{'descr'", ContentType.NPY),
        (b'{"uri": "s3://bucket/key"}', None),
        (b"RIFF\x24\0\0\0WAVEfmt ", None),  # RIFF, but audio
        (b"\x89PN", None),  # truncated
        (b"", None),
    ],
)
def test_sniff_content_type(data: bytes, expected: ContentType | None) -> None:
    assert sniff_content_type(data) == expected


def test_load_payload_reads_a_file_and_sniffs_it(tmp_path: Path) -> None:
    path = tmp_path / "digit.bin"  # the name says nothing; the bytes do
    path.write_bytes(PNG)
    assert load_payload(path, None, Limits()) == (PNG, ContentType.PNG)


def test_load_payload_keeps_an_explicit_content_type() -> None:
    assert load_payload(b'{"a": 1}', ContentType.JSON, Limits()) == (
        b'{"a": 1}',
        "application/json",
    )
    assert load_payload(PNG, "image/jpeg", Limits())[1] == "image/jpeg"


def test_unrecognised_bytes_ask_for_a_content_type() -> None:
    with pytest.raises(InvalidInput, match="content type"):
        load_payload(b"hello", None, Limits())


def test_unreadable_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "missing.png"
    with pytest.raises(InvalidInput, match=r"cannot read file .*missing\.png"):
        load_payload(missing, None, Limits())


def test_oversize_file_is_refused_with_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "big.png"
    path.write_bytes(PNG + b"\0" * 100)
    with pytest.raises(
        InvalidInput, match=rf"big\.png is {len(PNG) + 100} bytes, more than the 64"
    ):
        load_payload(path, None, Limits(max_payload_bytes=64))


def test_empty_payload_is_refused() -> None:
    with pytest.raises(InvalidInput, match="empty"):
        load_payload(b"", ContentType.PNG, Limits())


async def test_bad_input_fails_before_connecting(tmp_path: Path) -> None:
    """Every check runs before Kafka is touched: the unreachable broker is never reached."""
    good = tmp_path / "good.png"
    good.write_bytes(PNG)
    async with AsyncClient(UNREACHABLE) as client:
        with pytest.raises(InvalidInput, match="missing"):
            await client.submit_many([good, tmp_path / "missing.png"], model="digits")
        with pytest.raises(ContractError, match="ce_params"):
            await client.submit(PNG, model="digits", params={"y": object()})
        with pytest.raises(ContractError, match="ce_id"):
            await client.submit(PNG, model="digits", request_id="no spaces allowed")
        with pytest.raises(InvalidInput, match="model name"):
            await client.submit(PNG, model="a/b")
        with pytest.raises(InvalidInput, match="2 ids for 1 payloads"):
            await client.submit_many([PNG], model="digits", request_ids=["a", "b"])
        with pytest.raises(ContractError, match="request_id"):
            await client.result("not a valid id")


def test_sync_client_raises_the_same_errors_and_closes_twice() -> None:
    client = Client(UNREACHABLE)
    with pytest.raises(InvalidInput, match="content type"):
        client.submit(b"hello", model="digits")
    client.close()
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.result("abc")


def test_result_timeout_names_the_ids() -> None:
    one = ResultTimeout(["req-1"], 2.5)
    assert one.request_ids == ("req-1",)
    assert isinstance(one, TimeoutError)
    assert "within 2.5 s for request req-1:" in str(one)
    many = ResultTimeout([f"id{n}" for n in range(8)], 1)
    assert "8 requests id0, id1, id2, id3, id4 and 3 more" in str(many)
    assert len(many.request_ids) == 8


def test_unknown_model_names_the_topic_and_the_fix() -> None:
    err = UnknownModel("cats", "conveyor.cats.requests")
    assert "topic conveyor.cats.requests does not exist" in str(err)
    assert "conveyor topics create --model cats --partitions N" in str(err)


def test_settings_from_environment_and_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_KAFKA_BOOTSTRAP", "kafka:9092")
    monkeypatch.setenv("CONVEYOR_REDIS_URL", "redis://:hunter2@cache:6380/1")
    monkeypatch.setenv("CONVEYOR_MAX_BATCH_SIZE", "64")  # a worker's variable: ignored here
    settings = ClientSettings()
    assert settings.kafka_bootstrap == "kafka:9092"
    assert settings.redis_location == "redis://cache:6380/1"
    assert "hunter2" not in repr(settings)
    assert ClientSettings(kafka_bootstrap="other:1").kafka_bootstrap == "other:1"
    with pytest.raises(ValidationError):
        settings.kafka_bootstrap = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [("redis_url", "http://cache"), ("topic_prefix", "bad prefix"), ("connect_timeout_s", 0)],
)
def test_bad_settings_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        ClientSettings.model_validate({field: value})


@pytest.mark.parametrize(
    "argv",
    [
        ["--kafka-bootstrap", "k:1", "--redis-url", "redis://r:2/0", "result", "abc"],
        ["result", "abc", "--kafka-bootstrap", "k:1", "--redis-url", "redis://r:2/0"],
    ],
)
def test_connection_options_before_or_after_the_command(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    _apply_global_options(args)
    assert (args.kafka_bootstrap, args.redis_url) == ("k:1", "redis://r:2/0")


def test_worker_command_still_takes_its_options_and_the_global_ones() -> None:
    parser = build_parser()
    own = parser.parse_args(["worker", "--model", "digits", "--kafka-bootstrap", "k:1"])
    _apply_global_options(own)
    assert settings_from_args(own).kafka_bootstrap == "k:1"
    before = parser.parse_args(["--kafka-bootstrap", "k:2", "worker", "--model", "digits"])
    _apply_global_options(before)
    assert settings_from_args(before).kafka_bootstrap == "k:2"


@pytest.mark.parametrize(
    ("params", "message"),
    [("{not json", "--params is not valid JSON"), ("[1, 2]", "--params must be a JSON object")],
)
def test_cli_refuses_malformed_params_before_sending(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], params: str, message: str
) -> None:
    image = tmp_path / "a.png"
    image.write_bytes(PNG)
    argv = ["--kafka-bootstrap", "127.0.0.1:9", "submit", str(image), "--model", "m"]
    assert main([*argv, "--params", params]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_cli_names_an_unreadable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.png"
    assert main(["--kafka-bootstrap", "127.0.0.1:9", "submit", str(missing), "--model", "m"]) == 2
    assert f"cannot read file {missing}" in capsys.readouterr().err


def test_cli_reports_an_unreachable_broker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = tmp_path / "a.png"
    image.write_bytes(PNG)
    assert main(["--kafka-bootstrap", "127.0.0.1:9", "submit", str(image), "--model", "m"]) == 4
    err = capsys.readouterr().err
    assert "cannot reach Kafka at 127.0.0.1:9" in err
    assert "CONVEYOR_KAFKA_BOOTSTRAP" in err


def test_cli_reports_an_unreachable_redis(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--redis-url", "redis://127.0.0.1:9/0", "result", "abc"]) == 4
    assert "cannot reach Redis at redis://127.0.0.1:9/0" in capsys.readouterr().err


def test_progress_bar_ends_full() -> None:
    stream = io.StringIO()
    bar = ProgressBar(3, "results", stream)
    for _ in range(3):
        bar.advance()
    bar.close()
    assert stream.getvalue().rstrip("\n").endswith("[" + "#" * 30 + "] 3/3 results")


def test_client_package_imports_no_torch() -> None:
    """A client-only install has no torch: importing the SDK and its CLI must not need it."""
    code = (
        "import producers, producers.client, producers.cli, sys; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def _recorded_producers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, dict[str, object]]]:
    """Every producer the SDK's sender makes from now on, with the options it was given."""
    from aiokafka import AIOKafkaProducer

    import producers.sender as sender_module

    made: list[tuple[Any, dict[str, object]]] = []

    class Recorded(AIOKafkaProducer):  # type: ignore[misc]  # aiokafka is untyped: Any
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            made.append((self, kwargs))

    monkeypatch.setattr(sender_module, "AIOKafkaProducer", Recorded)
    return made


@contextmanager
def _silent_bootstrap() -> Iterator[str]:
    """The address of a listener that never answers: a producer's start hangs there."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        yield f"127.0.0.1:{silent.getsockname()[1]}"


async def test_a_send_cancelled_while_connecting_leaves_no_producer_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from producers.sender import RequestSender
    from producers.testing import until
    from schemas import encode_request

    made = _recorded_producers(monkeypatch)
    with _silent_bootstrap() as bootstrap:
        sender = RequestSender(ClientSettings(kafka_bootstrap=bootstrap, connect_timeout_s=30))
        record = encode_request(PNG, request_id="r1", content_type=ContentType.PNG, source="t")
        sending = asyncio.create_task(sender.send("digits", "conveyor.digits.requests", [record]))
        await until(lambda: bool(made), "the producer exists and is connecting", 5)
        await asyncio.sleep(0.2)
        sending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sending
        await sender.close()
    assert [producer._closed for producer, _ in made] == [True]


async def test_the_sdk_producer_puts_many_images_in_one_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from producers.errors import ServiceUnavailable
    from producers.sender import RequestSender
    from schemas import encode_request

    made = _recorded_producers(monkeypatch)
    record = encode_request(PNG, request_id="r1", content_type=ContentType.PNG, source="t")
    with _silent_bootstrap() as bootstrap:  # the send fails once the producer exists
        for settings in (
            ClientSettings(kafka_bootstrap=bootstrap, connect_timeout_s=0.2),
            ClientSettings(kafka_bootstrap=bootstrap, connect_timeout_s=0.2, send_batch_bytes=4096),
        ):
            sender = RequestSender(settings)
            with pytest.raises(ServiceUnavailable):
                await sender.send("digits", "conveyor.digits.requests", [record])
            await sender.close()
    # 1 MiB by default: 143 KB frames share a batch (aiokafka's 16 KB would not).
    assert [options["max_batch_size"] for _, options in made] == [1 << 20, 4096]


def test_keyword_clients_take_settings_as_keywords_with_plain_strings() -> None:
    client = Client(
        bootstrap="127.0.0.1:9",
        redis_url="redis://:hunter2@127.0.0.1:9/0",
        redis_password="s3cret",
        connect_timeout_s=2,
        track_status=True,
    )
    try:
        settings = client.settings
        assert settings.kafka_bootstrap == "127.0.0.1:9"
        assert isinstance(settings.redis_url, SecretStr)
        assert settings.redis_url.get_secret_value() == "redis://:hunter2@127.0.0.1:9/0"
        assert isinstance(settings.redis_password, SecretStr)
        assert "hunter2" not in repr(settings)
        assert "s3cret" not in repr(settings)
        assert settings.connect_timeout_s == 2
        assert settings.track_status
    finally:
        client.close()
    # kafka_bootstrap, the field's own name, works too; a ClientSettings positionally as before.
    assert AsyncClient(kafka_bootstrap="k:1").settings.kafka_bootstrap == "k:1"
    assert AsyncClient(UNREACHABLE).settings is UNREACHABLE


def test_keyword_clients_read_the_environment_for_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CONVEYOR_REDIS_URL", "redis://cache:6380/1")
    monkeypatch.setenv("CONVEYOR_KAFKA_BOOTSTRAP", "env-kafka:9092")
    settings = AsyncClient(bootstrap="given:9092").settings
    assert settings.kafka_bootstrap == "given:9092"  # keywords win
    assert settings.redis_location == "redis://cache:6380/1"


def test_an_unknown_keyword_names_the_valid_ones() -> None:
    with pytest.raises(TypeError) as raised:
        AsyncClient(bootstrap="k:1", redis="redis://r:1/0")  # type: ignore[call-arg]
    message = str(raised.value)
    assert "AsyncClient() got unexpected keyword arguments 'redis'" in message
    assert "valid are: bootstrap, " in message
    assert "redis_url" in message
    assert "kafka_bootstrap" in message
    with pytest.raises(TypeError, match=r"Client\(\) got unexpected keyword arguments 'kafka'"):
        Client(kafka="k:1")  # type: ignore[call-arg]


def test_settings_given_twice_are_refused() -> None:
    with pytest.raises(TypeError, match="a ClientSettings and keyword settings"):
        AsyncClient(UNREACHABLE, redis_url="redis://r:1/0")
    with pytest.raises(TypeError, match="both bootstrap and kafka_bootstrap"):
        AsyncClient(bootstrap="a:1", kafka_bootstrap="b:1")
    with pytest.raises(TypeError, match="takes a ClientSettings as its only positional"):
        AsyncClient("127.0.0.1:9092")  # type: ignore[arg-type]


def test_a_bad_keyword_value_names_the_field() -> None:
    with pytest.raises(ValidationError, match="redis_url"):
        AsyncClient(redis_url="http://cache")
    with pytest.raises(ValidationError, match="redis_max_connections"):
        AsyncClient(redis_max_connections=0)


def test_client_options_list_every_setting() -> None:
    assert set(ClientOptions.__annotations__) == set(ClientSettings.model_fields)


@pytest.mark.parametrize(
    ("raw", "fields", "tracked", "state", "sent_ms"),
    [
        (None, {}, False, "queued", None),  # untracked: queued or never sent, unknowable
        (None, {}, True, "unknown", None),  # clients record sends, and none did
        (None, {b"sent_ms": b"17"}, True, "queued", 17),
        (None, {b"sent_ms": b"17"}, False, "queued", 17),
        (None, {b"attempt": b"2", b"worker": b"w", b"started_ms": b"20"}, True, "running", None),
        (None, {b"sent_ms": b"17", b"attempt": b"1", b"started_ms": b"20"}, True, "running", 17),
    ],
)
def test_request_status_tells_unknown_from_queued_where_it_can(
    raw: bytes | None, fields: dict[bytes, bytes], tracked: bool, state: str, sent_ms: int | None
) -> None:
    status = request_status("id1", raw, fields, tracked)
    assert status.state == state
    assert status.sent_ms == sent_ms
    assert status.document()["state"] == state


def test_no_result_messages_say_plainly_what_is_known() -> None:
    unknown = _no_result(RequestStatus("id1", "unknown"), 5)
    assert unknown.startswith("no request with id id1 is known")
    untracked = _no_result(RequestStatus("id1", "queued"), 5)
    assert "it may still be queued, or no request with this id was ever sent" in untracked
    assert "CONVEYOR_TRACK_STATUS=true" in untracked
    sent = _no_result(RequestStatus("id1", "queued", sent_ms=17), None)
    assert "sent at 17 (epoch ms) and not started by any worker yet" in sent
    running = _no_result(RequestStatus("id1", "running", worker="w", started_ms=20, attempt=2), 5)
    assert "running on worker w since 20" in running


def test_pool_exhaustion_names_the_pool_and_its_settings() -> None:
    message = str(ConnectionsBusy(50, 30.0))
    assert "all 50 Redis connections of this client stayed busy for 30 s" in message
    assert "CONVEYOR_REDIS_MAX_CONNECTIONS" in message
    assert "is it running" not in message
    assert ConnectionsBusy.retriable


def test_subscription_commands_keep_their_order_and_merge() -> None:
    queue: list[tuple[Verb, str]] = [
        ("SUBSCRIBE", "a"),
        ("SUBSCRIBE", "b"),
        ("UNSUBSCRIBE", "a"),
        ("SUBSCRIBE", "a"),
        *(("SUBSCRIBE", f"c{n}") for n in range(600)),
    ]
    commands = _commands(queue)
    assert [(verb, len(channels)) for verb, channels in commands] == [
        ("SUBSCRIBE", 2),
        ("UNSUBSCRIBE", 1),
        ("SUBSCRIBE", 500),
        ("SUBSCRIBE", 101),
    ]
    assert commands[2][1][0] == "a"
