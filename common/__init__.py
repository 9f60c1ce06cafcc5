"""What the client and the worker share: connection settings, security and routing.

Dependencies point one way: ``schemas`` (the wire contract, no I/O) ← ``common`` ←
``producers`` (the SDK and the client commands) and ``workers`` (the server).
Nothing here imports ``producers``, ``workers`` or ``demo``
(``tests/unit/test_import_graph.py`` checks):

- ``security``: credentials and TLS for Kafka and Redis, and the options every
  client is built with;
- ``redis_cluster`` and ``cluster_keys``: routing keys to the primaries of a Redis Cluster;
- ``s3``: settings and a client for payloads stored by reference in S3;
- ``install``: the distribution's name and the pip command that adds an extra.
"""
