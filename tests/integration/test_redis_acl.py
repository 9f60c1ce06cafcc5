"""The Redis ACL users docs/security.md documents are enough, and no more than enough.

The rules are read from the page itself, the users created on the real Redis
(under names of this test's own), and then: a worker authenticated as the worker
user serves a request that a client authenticated as the caller user waits for;
the worker user can write a batch with a Lua script (SCRIPT LOAD, EVALSHA, EVAL
with SET, GET and PUBLISH); neither can touch anything else.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator

import pytest
import redis
from pydantic import SecretStr
from redis.exceptions import NoPermissionError, ResponseError

from producers import AsyncClient, ClientSettings, Status
from producers.admin import create_model_topics
from producers.testing import Fleet
from schemas import result_key
from tests.conftest import REPO

SECURITY_DOC = REPO / "docs" / "security.md"
# A script of the kind a worker runs per batch: first result wins, read back, announce.
BATCH_SCRIPT = """
local written = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', 60)
local stored = redis.call('GET', KEYS[1])
redis.call('PUBLISH', KEYS[1], '')
return stored
"""


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
        assert worker.eval(BATCH_SCRIPT, 1, keys[1], "other") == b"other"
        assert 0 < admin.ttl(keys[0]) <= 60
        with pytest.raises(NoPermissionError):
            worker.set(f"elsewhere:{uid}", "x")
        with pytest.raises((NoPermissionError, ResponseError), match=r"(?i)no permissions"):
            worker.eval(BATCH_SCRIPT, 1, f"elsewhere:{uid}", "x")
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
