#!/usr/bin/env bash
# Start or stop a Redis Cluster on 127.0.0.1, beside the Redis of redis.sh (other
# ports, another run folder), for cluster and failover tests: 3 primaries with one
# replica each, so a primary that dies is replaced by its replica.
#
# Node n (1..6) listens on REDIS_CLUSTER_PORT+n-1 (default 7000..7005) and talks to
# the other nodes on that port + 10000. A node is declared failed after
# REDIS_CLUSTER_NODE_TIMEOUT ms (default 2000) without answers; its replica then
# takes over. Nodes keep an append-only file, so a node that restarts before its
# replica took over comes back with its data instead of as an empty primary.
#
# Usage: redis-cluster.sh start|stop|status [NODE]    (NODE 1..6; default: every node)
# The first start creates the cluster (redis-cli --cluster create); later starts
# rejoin it from each node's nodes.conf. start waits until the cluster is serving
# (every slot covered, replicas linked); stop sends SIGTERM, then waits.
set -euo pipefail
source "$(dirname "$0")/env.sh"

PRIMARIES=3
REPLICAS=1
NODES=$((PRIMARIES * (1 + REPLICAS)))
REDIS_CLUSTER_PORT=${REDIS_CLUSTER_PORT:-7000}
REDIS_CLUSTER_NODE_TIMEOUT=${REDIS_CLUSTER_NODE_TIMEOUT:-2000}
CLUSTER_DIR=$RUN_DIR/redis-cluster-$REDIS_CLUSTER_PORT

port_of() { echo $((REDIS_CLUSTER_PORT + $1 - 1)); }
node_dir() { echo "$CLUSTER_DIR/node-$1"; }
pidfile_of() { echo "$(node_dir "$1")/redis.pid"; }
logfile_of() { echo "$(node_dir "$1")/redis.log"; }
pattern_of() { echo "redis-server $REDIS_HOST:$(port_of "$1")"; }

selected() {
  if [ -n "${1:-}" ]; then
    [[ "$1" =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ] && [ "$1" -le $NODES ] \
      || die "no node $1: the cluster has nodes 1 to $NODES"
    echo "$1"
  else
    seq 1 $NODES
  fi
}

ready() {
  python3 "$ROOT/compose/local/ready.py" redis-cluster "$REDIS_HOST" "$(port_of "$1")" \
    --replicas "$REPLICAS" --timeout "$READY_TIMEOUT" --pid "$(cat "$(pidfile_of "$1")")"
}

start() {
  local n started=() port
  for n in $(selected "${1:-}"); do
    if pid_alive "$(pidfile_of "$n")" "$(pattern_of "$n")"; then
      log "Redis Cluster node $n already running (pid $(cat "$(pidfile_of "$n")")) on $REDIS_HOST:$(port_of "$n")"
      continue
    fi
    for port in "$(port_of "$n")" $(($(port_of "$n") + 10000)); do
      if port_in_use "$port"; then
        die "cannot start Redis Cluster node $n: port $port on 127.0.0.1 is already in use by another process. Stop it, or choose free ports with REDIS_CLUSTER_PORT=<port> (nodes use it, the next $((NODES - 1)), and each of those + 10000). Log file: $(logfile_of "$n")"
      fi
    done
    started+=("$n")
  done
  [ ${#started[@]} -gt 0 ] || return 0
  apt_install redis-server redis-server
  for n in "${started[@]}"; do
    mkdir -p "$(node_dir "$n")"
    log "starting Redis Cluster node $n on $REDIS_HOST:$(port_of "$n") (log: $(logfile_of "$n"))"
    nohup redis-server --bind "$REDIS_HOST" --port "$(port_of "$n")" --dir "$(node_dir "$n")" \
      --cluster-enabled yes --cluster-config-file nodes.conf \
      --cluster-node-timeout "$REDIS_CLUSTER_NODE_TIMEOUT" \
      --appendonly yes --save "" --logfile "$(logfile_of "$n")" --daemonize no \
      >/dev/null 2>&1 </dev/null &
    echo $! >"$(pidfile_of "$n")"
  done
  for n in "${started[@]}"; do
    if ! python3 "$ROOT/compose/local/ready.py" redis "$REDIS_HOST" "$(port_of "$n")" \
        --timeout "$READY_TIMEOUT" --pid "$(cat "$(pidfile_of "$n")")"; then
      stop "${1:-}"
      fail_start "Redis Cluster node $n" "$(port_of "$n")" "$(logfile_of "$n")" REDIS_CLUSTER_PORT
    fi
  done
  if [ ! -f "$CLUSTER_DIR/created" ]; then
    local addresses=()
    for n in $(seq 1 $NODES); do addresses+=("$REDIS_HOST:$(port_of "$n")"); done
    log "creating the Redis Cluster: $PRIMARIES primaries, $REPLICAS replica each"
    redis-cli --cluster create "${addresses[@]}" --cluster-replicas "$REPLICAS" --cluster-yes \
      >"$CLUSTER_DIR/create.log" 2>&1 \
      || { stop; tail -n 20 "$CLUSTER_DIR/create.log" >&2; die "redis-cli --cluster create failed (log: $CLUSTER_DIR/create.log)"; }
    touch "$CLUSTER_DIR/created"
  fi
  for n in "${started[@]}"; do
    if ! ready "$n"; then
      stop "${1:-}"
      fail_start "Redis Cluster node $n" "$(port_of "$n")" "$(logfile_of "$n")" REDIS_CLUSTER_PORT
    fi
  done
  log "Redis Cluster ready: redis://$REDIS_HOST:$REDIS_CLUSTER_PORT/0 (CONVEYOR_REDIS_CLUSTER=true)"
}

stop() {
  local n
  for n in $(selected "${1:-}"); do
    stop_pid "$(pidfile_of "$n")" "$(pattern_of "$n")" "Redis Cluster node $n"
  done
}

status() {
  local n down=0
  for n in $(selected "${1:-}"); do
    if pid_alive "$(pidfile_of "$n")" "$(pattern_of "$n")"; then
      echo "redis cluster node $n running pid $(cat "$(pidfile_of "$n")") port $(port_of "$n")"
    else
      echo "redis cluster node $n stopped"
      down=1
    fi
  done
  return $down
}

case "${1:-}" in
  start) start "${2:-}" ;;
  stop) stop "${2:-}" ;;
  status) status "${2:-}" ;;
  *) die "usage: redis-cluster.sh start|stop|status [NODE]" ;;
esac
