#!/usr/bin/env bash
# Kafka's kafka-acls tool (AclCommand) from the jars compose/local fetches: list, add and
# remove a broker's ACLs, e.g. the ones docs/security.md gives a worker. Arguments are
# kafka-acls' own; on the broker of `SECURE_ACLS=1 secure.sh start`, the loopback
# listener (SECURE_KAFKA_PORT + 2) needs no credentials and may change any ACL:
#   compose/local/kafka-acls.sh --bootstrap-server 127.0.0.1:9194 --list
set -euo pipefail
source "$(dirname "$0")/env.sh"
"$ROOT/compose/local/fetch-kafka.sh"
# The tool logs only warnings, to stderr (the broker's log4j2 file writes to a log folder).
exec java -cp "$KAFKA_LIBS/*" -Dlog4j2.level=WARN -Xshare:auto -XX:TieredStopAtLevel=1 \
  org.apache.kafka.tools.AclCommand "$@"
