#!/usr/bin/env bash
# System tools the tests and the demo use beside Python packages: kcat (a plain
# Kafka client, to prove the contract works without our code) and redis-server.
set -euo pipefail
source "$(dirname "$0")/env.sh"
apt_install kcat kcat
apt_install redis-server redis-server
