"""common.redis_cluster and the cluster settings: slot maps, routes and URLs, no Redis needed."""

from __future__ import annotations

import pytest
from pydantic import SecretStr, ValidationError
from redis.crc import key_slot
from redis.exceptions import AuthenticationError, ClusterDownError, MovedError, ResponseError

from common.redis_cluster import ClusterRouter, Node, check_cluster_url, is_topology_error
from producers.settings import ClientSettings
from schemas import result_key
from workers.config.worker import WorkerSettings

# What CLUSTER SLOTS answers for 3 primaries with a replica each (the order of
# ranges is the server's, not necessarily by slot).
SLOTS = [
    [5461, 10922, [b"10.0.0.2", 7001, b"id2", {}], [b"10.0.0.5", 7004, b"id5", {}]],
    [0, 5460, [b"10.0.0.1", 7000, b"id1", {}], [b"10.0.0.4", 7003, b"id4", {}]],
    [10923, 16383, [b"", 7002, b"id3", {}], [b"10.0.0.6", 7005, b"id6", {}]],
]


def _router(url: str = "redis://10.0.0.9:7000/0") -> ClusterRouter:
    router = ClusterRouter(url, {})
    router._load(SLOTS, Node("10.0.0.3", 7002))  # as refresh() does with an answer
    return router


async def test_keys_are_grouped_by_primary_then_by_slot() -> None:
    router = _router()
    keys = [result_key(f"r{n}") for n in range(200)]
    plan = await router.by_node(keys)
    # An empty address means the node that was asked.
    assert set(plan) == {Node("10.0.0.1", 7000), Node("10.0.0.2", 7001), Node("10.0.0.3", 7002)}
    assert sorted(k for slots in plan.values() for ks in slots.values() for k in ks) == sorted(keys)
    for node, slots in plan.items():
        for slot, grouped in slots.items():
            assert {key_slot(k.encode()) for k in grouped} == {slot}
            first = {Node("10.0.0.1", 7000): 0, Node("10.0.0.2", 7001): 5461}.get(node, 10923)
            assert first <= slot


async def test_moved_routes_its_slot_at_once_until_the_next_map() -> None:
    router = _router()
    key = result_key("moving")
    slot = key_slot(key.encode())
    router.moved(MovedError(f"{slot} 10.0.0.7:7009"))
    assert list(await router.by_node([key])) == [Node("10.0.0.7", 7009)]
    other = next(k for n in range(100) if key_slot((k := result_key(f"o{n}")).encode()) != slot)
    assert Node("10.0.0.7", 7009) not in await router.by_node([other])
    router._load(SLOTS, Node("10.0.0.1", 7000))  # a fresh map replaces what MOVED said
    assert Node("10.0.0.7", 7009) not in await router.by_node([key])
    assert await router.primaries() == [
        Node("10.0.0.1", 7000),
        Node("10.0.0.2", 7001),
        Node("10.0.0.1", 7002),  # the empty address, asked of 10.0.0.1 this time
    ]


async def test_a_slot_no_node_serves_is_cluster_down() -> None:
    router = ClusterRouter("redis://10.0.0.9:7000/0", {})
    router._load(SLOTS[:2], Node("10.0.0.1", 7000))
    uncovered = next(k for n in range(100) if key_slot((k := f"k{n}").encode()) > 10922)
    with pytest.raises(ClusterDownError, match="not served"):
        await router.by_node([uncovered])


async def test_the_parts_of_a_call_teach_their_routes_before_its_first_error_is_raised() -> None:
    router = _router()
    key = result_key("moving")
    slot = key_slot(key.encode())
    assert router.learned([1, 2]) == [1, 2]
    moved, lost = MovedError(f"{slot} 10.0.0.7:7009"), ConnectionError("node gone")
    with pytest.raises(MovedError):
        router.learned([1, moved, lost])
    assert router._stale  # the lost node: the map is loaded again before the next routing
    router._stale = False  # by_node routes without loading a map (no node is there)
    assert list(await router.by_node([key])) == [Node("10.0.0.7", 7009)]  # MOVED: the new route
    with pytest.raises(AuthenticationError):  # refused credentials teach nothing
        router.learned([AuthenticationError("no")])
    assert not router._stale


async def test_node_clients_keep_the_urls_scheme_and_credentials() -> None:
    router = ClusterRouter("rediss://worker:s3cret@seed.example:7000/0", {"socket_timeout": 3})
    client = router.client(Node("10.0.0.2", 7001))
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("10.0.0.2", 7001, 0)
    assert (kwargs["username"], kwargs["password"]) == ("worker", "s3cret")
    assert kwargs["socket_timeout"] == 3
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"
    assert router.client(Node("10.0.0.2", 7001)) is client  # one client per node
    await router.aclose()


def test_topology_errors_are_the_ones_a_new_map_may_cure() -> None:
    assert is_topology_error(MovedError("1 10.0.0.1:7000"))
    assert is_topology_error(ClusterDownError("CLUSTERDOWN"))
    assert is_topology_error(ConnectionRefusedError())
    assert not is_topology_error(AuthenticationError("WRONGPASS"))  # a ConnectionError
    assert not is_topology_error(ResponseError("NOPERM"))


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("unix:///tmp/redis.sock", "redis:// or rediss://"),
        ("redis://10.0.0.1:7000/3", "only database 0"),
    ],
)
def test_cluster_urls_are_checked(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_cluster_url(url)
    with pytest.raises(ValidationError, match=problem):
        ClientSettings(redis_url=SecretStr(url), redis_cluster=True)
    with pytest.raises(ValidationError, match=problem):
        WorkerSettings(model="digits", redis_url=SecretStr(url), redis_cluster=True)
    check_cluster_url("redis://10.0.0.1:7000")  # no database named: 0


def test_replica_acks_need_a_cluster() -> None:
    with pytest.raises(ValidationError, match="redis_replica_acks needs redis_cluster"):
        WorkerSettings(model="digits", redis_replica_acks=1)
    settings = WorkerSettings(model="digits", redis_cluster=True, redis_replica_acks=1)
    assert (settings.redis_cluster, settings.redis_replica_acks) == (True, 1)
