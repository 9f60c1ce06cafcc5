"""The Redis ACL users docs/security.md documents are enough, and no more than enough.

The rules are read from the page itself, the users created on a real Redis of this
module's own (under names of each test's own), and then: a worker authenticated as the worker
user serves a request that a client authenticated as the caller user waits for;
the worker user can write a batch with a Lua script (SCRIPT LOAD, then EVALSHA
with SET, GET and PUBLISH); neither can touch anything else.

Then each grant of the worker's rule is taken away in turn, and a real worker must
stop with status 3 and one line naming that grant, having written and committed
nothing; with the grant back, a second worker answers every request and callers
that waited all along are woken (docs/reliability.md, "Refused permissions"). A
worker stuck on such a refusal stops within its drain bound on SIGINT (SIGTERM, which
reaches the same handler, is tried in test_kafka_acl.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import signal
import time
from collections.abc import Iterator

import pytest
import redis
from aiokafka.admin import AIOKafkaAdminClient
from pydantic import SecretStr
from redis.exceptions import NoPermissionError, ResponseError

from producers import AsyncClient, ClientSettings, Result, Status
from producers.admin import create_model_topics
from producers.testing import (
    Fleet,
    WorkerProcess,
    count_results,
    free_port,
    http_get,
    produce,
    until,
)
from schemas import consumer_group, result_key, topics_for
from tests.conftest import REPO
from tests.harness import (
    NOTES,
    LocalService,
    check,
    digit_requests,
    logged_at,
    metrics,
    tally_scenario,
)
from workers.app import CLOSE_S

# One test process runs the module: its Redis starts once under pytest -n.
pytestmark = pytest.mark.xdist_group("redis-acl")

SECURITY_DOC = REPO / "docs" / "security.md"
# A script of the kind a worker runs per batch: first result wins, read back, announce.
BATCH_SCRIPT = """
local written = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', 60)
local stored = redis.call('GET', KEYS[1])
redis.call('PUBLISH', KEYS[1], '')
return stored
"""


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """This module's Redis (for its workers, clients and users alike): its tests empty the
    script cache so that a limited worker must load the script itself, which the shared
    Redis cannot promise while other tests' workers load it beside them."""
    service = LocalService("redis.sh", free_port(), tmp_path_factory.mktemp("redis-acl"))
    service.start()
    yield service.url
    service.stop()


def _documented_rules(role: str) -> list[str]:
    match = re.search(rf"^ACL SETUSER conveyor-{role} (.+)$", SECURITY_DOC.read_text(), re.M)
    assert match, f"docs/security.md documents no conveyor-{role} user"
    return match.group(1).split()


@pytest.fixture
def acl_user(redis_url: str, uid: str) -> Iterator[dict[str, tuple[str, str]]]:
    """{role: (user, password)} for the worker and caller users of the docs."""
    admin = redis.Redis.from_url(redis_url)
    users: dict[str, tuple[str, str]] = {}
    try:
        for role in ("worker", "caller"):
            name, password = f"conveyor-{role}-{uid}", secrets.token_hex(16)
            rules = [
                f">{password}" if rule.startswith(">") else rule for rule in _documented_rules(role)
            ]
            # redis-py leaves execute_command untyped; the rules are the docs' own words.
            admin.execute_command("ACL", "SETUSER", name, *rules)  # type: ignore[no-untyped-call]
            users[role] = (name, password)
        yield users
    finally:
        for name, _password in users.values():
            admin.acl_deluser(name)
        admin.close()


def _as(redis_url: str, user: tuple[str, str]) -> redis.Redis:
    return redis.Redis.from_url(redis_url, username=user[0], password=user[1])


def _settings_as(settings: ClientSettings, user: tuple[str, str], **more: object) -> ClientSettings:
    """``settings`` with Redis reached as ``user`` (name, password), and ``more`` fields."""
    name, password = user
    update = {"redis_username": name, "redis_password": SecretStr(password), **more}
    return settings.model_copy(update=update)


@pytest.mark.timeout(240)
async def test_documented_users_serve_and_wait_for_a_request(
    acl_user: dict[str, tuple[str, str]],
    client_settings: ClientSettings,
    model_name: str,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    await create_model_topics(client_settings, model_name, partitions=1)
    name, password = acl_user["worker"]
    worker = workers.start(
        env={"CONVEYOR_REDIS_USERNAME": name, "CONVEYOR_REDIS_PASSWORD": password}
    )
    settings = _settings_as(client_settings, acl_user["caller"])
    try:
        png, digit = digits[0]
        async with AsyncClient(settings) as client:
            request_id = await client.submit(png, model=model_name)
            result = await client.wait(request_id, timeout=180)
            again = await client.result(request_id)
    finally:
        worker.stop()
    assert result.status is Status.ok, worker.log()
    assert result.outputs[0]["label"] == str(digit)
    assert again == result
    assert "NOPERM" not in worker.log()


def test_worker_user_can_write_a_batch_with_a_script_and_nothing_else(
    acl_user: dict[str, tuple[str, str]], redis_url: str, uid: str
) -> None:
    worker = _as(redis_url, acl_user["worker"])
    admin = redis.Redis.from_url(redis_url)
    keys = [result_key(f"{uid}-{n}") for n in range(2)]
    try:
        sha = worker.script_load(BATCH_SCRIPT)
        assert worker.evalsha(sha, 1, keys[0], "first") == b"first"
        assert worker.evalsha(sha, 1, keys[0], "second") == b"first"  # first final wins
        assert worker.evalsha(sha, 1, keys[1], "other") == b"other"
        assert 0 < admin.ttl(keys[0]) <= 60
        with pytest.raises(NoPermissionError):
            worker.set(f"elsewhere:{uid}", "x")
        with pytest.raises((NoPermissionError, ResponseError), match=r"(?i)no permissions"):
            worker.evalsha(sha, 1, f"elsewhere:{uid}", "x")
        with pytest.raises(NoPermissionError):
            worker.eval(BATCH_SCRIPT, 1, keys[1], "other")  # not needed: never granted
        with pytest.raises(NoPermissionError):
            worker.flushall()
    finally:
        worker.close()
        admin.delete(*keys)
        admin.close()


def test_caller_user_reads_but_cannot_write_results(
    acl_user: dict[str, tuple[str, str]], redis_url: str, uid: str
) -> None:
    key = result_key(f"{uid}-read")
    admin = redis.Redis.from_url(redis_url)
    admin.set(key, b"{}", ex=60)
    caller = _as(redis_url, acl_user["caller"])
    try:
        assert caller.get(key) == b"{}"
        assert caller.mget([key]) == [b"{}"]
        with pytest.raises(NoPermissionError):
            caller.set(key, b"forged")
        with pytest.raises(NoPermissionError):
            caller.publish(key, b"")
        pubsub = caller.pubsub()  # type: ignore[no-untyped-call]  # untyped in redis-py
        pubsub.subscribe(key)
        deadline = time.monotonic() + 5
        while (message := pubsub.get_message(timeout=1)) is None and time.monotonic() < deadline:
            pass
        assert message is not None
        assert message["type"] == "subscribe"
        pubsub.close()
    finally:
        caller.close()
        admin.delete(key)
        admin.close()


async def test_a_read_only_caller_is_told_its_large_payload_cannot_be_stored(
    acl_user: dict[str, tuple[str, str]], client_settings: ClientSettings, uid: str
) -> None:
    """Payloads above the threshold go to Redis by reference; a caller whose user may
    not write there gets a clear refusal, not an outage to retry."""
    from producers.claims import PayloadStoreRefused

    settings = _settings_as(client_settings, acl_user["caller"], dataref_threshold_bytes=1024)
    async with AsyncClient(settings) as client:
        with pytest.raises(PayloadStoreRefused, match=r"conveyor:data:\*, which needs \+set"):
            await client.submit(b"\x89PNG" + bytes(4096), model=f"m{uid}", content_type="image/png")


# -- one grant taken away ------------------------------------------------------------------

KEYS, CHANNELS = "~conveyor:result:*", "&conveyor:result:*"
GRACE_S = 3  # --permanent-error-grace-s (60 s by default)
DRAIN_MS = 2000  # --max-drain-ms (20 s by default)
REQUESTS = 5


class Limited:
    """A model's requests, a Redis user with the worker's documented rule less one grant,
    and callers waiting on every request from before any worker starts."""

    def __init__(
        self,
        redis_url: str,
        client_settings: ClientSettings,
        kafka_admin: AIOKafkaAdminClient,
        model: str,
        uid: str,
        removed: str,
    ) -> None:
        self.redis_url, self.settings, self.kafka_admin = redis_url, client_settings, kafka_admin
        self.model, self.removed = model, removed
        self.user, self.password = f"conveyor-worker-{uid}", secrets.token_hex(16)
        self.ids: list[str] = []
        self.waits: list[asyncio.Future[Result]] = []

    def env(self) -> dict[str, str]:
        return {"CONVEYOR_REDIS_USERNAME": self.user, "CONVEYOR_REDIS_PASSWORD": self.password}

    async def set_up(self, digits: list[tuple[bytes, int]], client: AsyncClient) -> None:
        rules = [
            f">{self.password}" if rule.startswith(">") else rule
            for rule in _documented_rules("worker")
            if rule != self.removed
        ]
        admin = redis.Redis.from_url(self.redis_url)
        try:
            admin.execute_command("ACL", "SETUSER", self.user, *rules)  # type: ignore[no-untyped-call]
            # As after a restart: the worker must load its script (else an earlier test's
            # worker may have, and +script|load would go untested).
            admin.script_flush()
        finally:
            admin.close()
        await create_model_topics(self.settings, self.model, partitions=1)
        records, self.ids = digit_requests(digits, REQUESTS, self.model)
        await produce(self.settings.kafka_bootstrap, topics_for(self.model).requests, records)
        self.waits = [asyncio.ensure_future(client.wait(i, timeout=240)) for i in self.ids]

    async def nothing_written_nor_committed(self) -> None:
        assert await count_results(self.redis_url, self.ids) == 0
        group = consumer_group(self.model)
        assert await self.kafka_admin.list_consumer_group_offsets(group) == {}

    def grant_again(self) -> None:
        admin = redis.Redis.from_url(self.redis_url)
        try:
            admin.execute_command("ACL", "SETUSER", self.user, self.removed)  # type: ignore[no-untyped-call]
        finally:
            admin.close()

    async def answered_once_fixed(self, workers: Fleet, scenario: str) -> None:
        """With the grant back, a worker answers every request, each waiter is woken by
        its announcement, and no first answer counts as a duplicate."""
        self.grant_again()
        worker = workers.start(env=self.env())
        done = await worker.unless_it_dies(asyncio.wait_for(asyncio.gather(*self.waits), 180))
        assert all(result.status is Status.ok for result in done), worker.log()
        counted = await tally_scenario(
            scenario, self.settings.kafka_bootstrap, self.redis_url, self.model, self.ids
        )
        check(counted, workers.logs())
        assert (await metrics(worker)).get("conveyor_redeliveries_total", 0) == 0

    def close(self) -> None:
        for wait in self.waits:
            wait.cancel()
        admin = redis.Redis.from_url(self.redis_url)
        try:
            admin.acl_deluser(self.user)
        finally:
            admin.close()


@pytest.fixture
def limited(
    request: pytest.FixtureRequest,
    redis_url: str,
    client_settings: ClientSettings,
    kafka_admin: AIOKafkaAdminClient,
    model_name: str,
    uid: str,
) -> Iterator[Limited]:
    grants = Limited(
        redis_url, client_settings, kafka_admin, model_name, uid, removed=request.param
    )
    try:
        yield grants
    finally:
        grants.close()


async def _unready_until_exit(worker: WorkerProcess) -> bool:
    """Whether /readyz failed on results_durable at some point before the worker exited."""
    seen = False
    while worker.running():
        port = worker.metrics_port()
        if port is not None:
            try:
                status, body = await http_get(port, "/readyz")
            except OSError:
                status, body = 0, b""
            if status == 503 and json.loads(body)["checks"]["results_durable"] != "ok":
                seen = True
        await asyncio.sleep(0.1)  # polling the probe, not waiting for readiness
    return seen


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("limited", "named"),
    [
        pytest.param("+evalsha", "+evalsha", id="evalsha"),
        pytest.param("+script|load", "+script|load", id="script-load"),
        pytest.param("+set", f"+set on {KEYS}", id="set"),
        pytest.param("+get", f"+get on {KEYS}", id="get"),
        pytest.param("+publish", "+publish", id="publish"),
        pytest.param(KEYS, KEYS, id="keys"),
        pytest.param(CHANNELS, CHANNELS, id="channels"),
        pytest.param("+ping", "+ping", id="ping"),
    ],
    indirect=["limited"],
)
async def test_without_a_grant_the_worker_exits_3_naming_it_and_nothing_is_lost(
    limited: Limited,
    named: str,
    client_settings: ClientSettings,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    async with AsyncClient(client_settings) as client:
        await limited.set_up(digits, client)
        started = time.time()
        worker = workers.start("--permanent-error-grace-s", str(GRACE_S), env=limited.env())
        unready = asyncio.ensure_future(_unready_until_exit(worker))
        status = await worker.exited(120)
        exited = time.time()
        log = worker.log()
        assert status == 3, log
        assert f"grant {'it' if named == '+ping' else 'its user'} {named}" in log.splitlines()[-1]
        naming = [line for line in log.splitlines() if " ERROR " in line and named in line]
        if named == "+ping":  # refused before anything was fetched: the exit line alone
            refused_at = exited
            assert not naming, log
            assert not unready.done() or not unready.result()
        else:  # one line when the refusal starts, the worker unready from then on
            assert len(naming) == 1, log
            refused_at = logged_at(naming[0])
            assert await unready, log
            assert exited - refused_at >= GRACE_S - 0.5
        await limited.nothing_written_nor_committed()
        await limited.answered_once_fixed(workers, f"Redis ACL without {limited.removed}")
    after_refusal = (
        f"{exited - refused_at:.1f} s after the first refusal (grace {GRACE_S} s)"
        if refused_at < exited
        else "at start-up"
    )
    NOTES.append(
        f"Redis ACL without {limited.removed}: exit {status} {exited - started:.1f} s after "
        f"start, {after_refusal}; names {named}"
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("limited", ["+eval"], indirect=True)
async def test_the_worker_needs_no_eval(
    limited: Limited,
    client_settings: ClientSettings,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    """The documented rule has no +eval: redis-py loads a script Redis lacks with SCRIPT
    LOAD, never with EVAL, so a worker serves with it from an empty script cache."""
    assert "+eval" not in _documented_rules("worker")
    async with AsyncClient(client_settings) as client:
        await limited.set_up(digits, client)
        worker = workers.start(env=limited.env())
        done = await worker.unless_it_dies(asyncio.wait_for(asyncio.gather(*limited.waits), 180))
    assert all(result.status is Status.ok for result in done), worker.log()
    counted = await tally_scenario(
        "Redis ACL without +eval",
        client_settings.kafka_bootstrap,
        limited.redis_url,
        limited.model,
        limited.ids,
    )
    check(counted, workers.logs())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("limited", ["+set"], indirect=True)
async def test_a_worker_stuck_on_a_refusal_stops_on_sigint_within_its_drain_bound(
    limited: Limited,
    client_settings: ClientSettings,
    workers: Fleet,
    digits: list[tuple[bytes, int]],
) -> None:
    async with AsyncClient(client_settings) as client:
        await limited.set_up(digits, client)
        options = ("--permanent-error-grace-s", "600", "--max-drain-ms", str(DRAIN_MS))
        worker = workers.start(*options, env=limited.env())
        refused = f"grant its user +set on {KEYS}"
        await until(lambda: refused in worker.log(), "the refusal", 120, worker.log, [worker])
        signalled = time.monotonic()
        worker.signal(signal.SIGINT)
        status = await worker.exited(60)
        took = time.monotonic() - signalled
        assert status == 0, worker.log()
        assert "drain cut short" in worker.log()
        assert took < DRAIN_MS / 1000 + CLOSE_S, worker.log()
        await limited.nothing_written_nor_committed()
        await limited.answered_once_fixed(workers, "SIGINT while Redis refuses +set")
    NOTES.append(
        f"SIGINT while Redis refuses +set: exit {status} {took:.1f} s after the signal "
        f"(--max-drain-ms {DRAIN_MS})"
    )
