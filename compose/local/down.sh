#!/usr/bin/env bash
# Stop what up.sh (and seaweedfs.sh start) started (found through its pid files); leaves other processes alone.
set -euo pipefail
here=$(dirname "$0")
"$here/kafka.sh" stop
"$here/redis.sh" stop
"$here/seaweedfs.sh" stop
