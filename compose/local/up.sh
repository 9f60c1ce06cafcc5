#!/usr/bin/env bash
# Start the local Kafka broker and Redis server (idempotent).
set -euo pipefail
here=$(dirname "$0")
"$here/redis.sh" start
"$here/kafka.sh" start
