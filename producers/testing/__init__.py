"""Drive real workers from outside, as a client does: the harness of the tests and benchmarks.

It launches ``conveyor worker`` as child processes (never importing the worker,
so a client-only install can drive a worker installed elsewhere), waits for
them to be ready, stops, kills or freezes them; creates topics through
``producers.admin``; produces backlogs and paced load; waits for, reads and
tallies results in Redis and on the reply topic. Everything talks to the real
Kafka and Redis it is pointed at.

- ``processes``: ``WorkerConfig``, ``WorkerProcess``, ``Fleet``, readiness and ``until``.
- ``net``: ``free_port`` for a service's port, ``http_get`` for a worker's endpoints.
- ``kafka``: ``kafka_admin``, ``requests``, ``produce``, ``produce_at_rate``, ``read_topic``.
- ``results``: ``read_results``, ``await_results``, ``wait_for_results``, ``tally``.
"""

from producers.testing.kafka import (
    Isolation,
    Reply,
    kafka_admin,
    produce,
    produce_at_rate,
    read_topic,
    requests,
)
from producers.testing.net import free_port, free_ports, http_get
from producers.testing.processes import (
    CLUSTER_SCHEME,
    WORKER_COMMAND,
    Fleet,
    WorkerConfig,
    WorkerExited,
    WorkerProcess,
    is_cluster,
    plain_url,
    unless_one_exits,
    until,
    until_all_ready,
)
from producers.testing.results import (
    Tally,
    await_results,
    count_results,
    delete_results,
    read_results,
    redis_reader,
    tally,
    until_answered,
    wait_for_results,
)

__all__ = [
    "CLUSTER_SCHEME",
    "WORKER_COMMAND",
    "Fleet",
    "Isolation",
    "Reply",
    "Tally",
    "WorkerConfig",
    "WorkerExited",
    "WorkerProcess",
    "await_results",
    "count_results",
    "delete_results",
    "free_port",
    "free_ports",
    "http_get",
    "is_cluster",
    "kafka_admin",
    "plain_url",
    "produce",
    "produce_at_rate",
    "read_results",
    "read_topic",
    "redis_reader",
    "requests",
    "tally",
    "unless_one_exits",
    "until",
    "until_all_ready",
    "until_answered",
    "wait_for_results",
]
